"""Weight delivery on the learner's side: the publisher (`publish`), the broadcast
group's rank 0 (`broadcast`), stream catch-up (`catch_up`) and the held versions
FetchWeights serves (`weight_store`)."""

"""Weight delivery on the learner's side: the publisher (`publish`), the broadcast
group's rank 0 (`broadcast`) and stream catch-up (`catch_up`); the held versions
FetchWeights serves are `scalerl.policy.weight_store` (a relaying worker holds them too)."""

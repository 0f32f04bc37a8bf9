"""Weight delivery: how a policy version travels from the learner to the engines that
serve it (`delta`: lossless delta versions)."""

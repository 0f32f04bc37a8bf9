"""The reward service (`scalerl-reward`): a sequence-classification reward model scoring
(prompt, completion) pairs over gRPC, for the `reward_model` verifier."""

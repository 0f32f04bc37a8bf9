"""The optimizer step: the ScaleRL trainer (`trainer`), the recipe's loss and advantage
terms (`recipe`), packing and micro-batches, log-probs, the supervised warm-up, and the
ranks of a sharded learner (`ranks`, `sharding`)."""

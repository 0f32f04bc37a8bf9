"""Weight delivery on the worker's side: receiving an UpdateWeights stream or file
(`receive`), fetching from the learner (`pull`), the broadcast group's member
(`broadcast`), and the `WeightFollower` that keeps the engine at the latest version
(`follower`)."""

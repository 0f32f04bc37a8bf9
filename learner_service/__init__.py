"""learner_service package."""

"""rollout_service package."""

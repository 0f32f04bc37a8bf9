"""Rollout engines."""

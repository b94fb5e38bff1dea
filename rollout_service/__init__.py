"""Rollout service: inference servers and the rollout controller."""

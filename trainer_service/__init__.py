"""The DeepSpeed trainer service: recompute, decoupled PPO, publish weights, checkpoint."""

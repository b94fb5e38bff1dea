"""Programs that run inside containers and Slurm steps (entry point, readiness probe,
reaper, Slurm step runtime); the renderers in `hexctl.deploy` only name them."""

"""`areal-hex profile`: every profiler of devices. `bare`: a model's transformers forwards
and a torch step on one device; `local` (with `devices`, `generation`, `training`,
`controller`, `cache`): the job's own engines on the devices `run` uses here. A box's
kinds are timed with the same code inside their nodes (`hexctl/box/profile.py`)."""

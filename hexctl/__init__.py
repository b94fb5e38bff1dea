"""The face of areal-hex: what a user types (`cli`) and what it starts or renders.

Floors, top to bottom (each imports only the floors below it and the services):
  cli      the `areal-hex` command: argument parsing only
  bench    `areal-hex bench NAME`: every benchmark, each against a same-run baseline
  launch   `areal-hex run`: the services as local supervised processes
  profile | report | deploy | runtime
           measuring this machine | summaries, plots, evaluation | compose, k8s and Slurm
           rendering | the programs that run inside containers and Slurm steps
  job      what the launcher and deploy both need: the run's layout, warm start, the
           plan -> config projection, predictions and fidelity
"""

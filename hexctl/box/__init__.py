"""The box: a heterogeneous cluster emulated on this Linux machine, and a job on it.

- `spec`: the box YAML (kinds, racks, nodes) and its shape's checks;
- `checks`: what the machine and a budget must allow, before any long work;
- `random_box`: `box random`, a feasible box drawn from a seed;
- `emulate`: `box up|down`, the namespaces, shaped links and CPU cgroups, the state file;
- `cgroups`: each node's quota, weight and accounting group, and their removal by name;
- `speed`: a node's speed under its quota;
- `delivered`: what the machine delivered to each node over a run's window;
- `profile`: `profile --box`, each kind timed inside one of its nodes;
- `run_config`: a run's config on the box (the services' addresses);
- `place`: a run's processes started inside their nodes.

`areal-hex run run.box=NAME` hands `run_config.apply_box` and `place.place_on_box` to the
launcher; `areal-hex box` (`hexctl/cli/box_cmd.py`) and `bench hetero` drive the rest.
"""

"""What the local launcher and the deploy renderers both need: where services run and how
they are reached (layout), the initial weights (warm start), the single plan -> config
projection, the run's prediction and its fidelity against the measurement."""

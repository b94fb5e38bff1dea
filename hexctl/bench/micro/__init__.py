"""Microbenchmarks: one service's internals (the buffer, the controller, the inference
server, the trainer step, weight sync, the planner) against a bare baseline of the same
work, in one process or a few, with no launcher, plan or box."""

"""The areal-hex planner: places rollout and training pools on heterogeneous GPUs.

Phase 1 (`milp`) picks how many GPUs of each kind and zone serve rollout or training and
with which parallel configuration; phase 2 (`partition`) picks the concrete GPUs with
METIS; `simulator` replays a plan; `planner.make_plan` ties them together.
"""

from __future__ import annotations

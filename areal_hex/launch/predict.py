"""What the cost model predicts for the layout a local run starts with (`prediction.json`).

With a plan, the layout is the plan's (its instances and trainer) and the cost model's
inputs are those the plan was made from (`plan.sources`); without one, it is the layout
`run` builds from the config (N servers, one trainer) on the devices of a local profile
(`areal-hex profile --local`, passed as `run --profile DIR`). Either way the same function
(`scheduler.predict.predict_layout`) prices it, for the mode the run runs in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_hex.config import ConfigError, ExperimentConfig
from areal_hex.plan import Plan


def _inputs(
    cfg: ExperimentConfig, plan: Plan | None, profile_dir: Path | None
) -> tuple[Path, Path, Path | None, str] | str:
    """(cluster, workload, profile, model) paths, or why there are none."""
    if plan is not None:
        src = plan.sources
        if src is None or src.workload is None:
            return "the plan does not name the cluster spec and workload it was made from"
        named = (src.cluster, src.workload, src.profile)
        missing = [p for p in named if p and not Path(p).exists()]
        if missing:
            return f"the plan's inputs are gone: {', '.join(missing)}"
        return (
            Path(src.cluster),
            Path(src.workload),
            (Path(src.profile) if src.profile else None),
            plan.model,
        )
    if profile_dir is None:
        return "no plan and no local profile (areal-hex run --profile DIR, from profile --local)"
    from areal_hex.launch.local_profile import LocalProfileFiles

    f = LocalProfileFiles(profile_dir)
    for p in (f.cluster, f.workload, f.profile):
        if not p.is_file():
            return f"{p} is missing (areal-hex profile --local --out-dir {profile_dir} writes it)"
    return f.cluster, f.workload, f.profile, str(f.model)


def _layout(cfg: ExperimentConfig, plan: Plan | None, cl: Any) -> tuple[list, Any]:
    from scheduler.predict import TrainerLayout

    group_of = {f"{g.name}-{i}": g.name for g in cl.spec.node_groups for i in range(g.nodes)}
    if plan is not None:
        inst = [(group_of.get(i.placement.node, "?"), i.tp) for i in plan.rollout]
        parts: dict[str, int] = {}
        for p in plan.trainer.placements:
            g = group_of.get(p.node, "?")
            parts[g] = parts.get(g, 0) + len(p.gpu_ids)
        per_node = max(len(p.gpu_ids) for p in plan.trainer.placements)
        return inst, TrainerLayout(tuple(parts.items()), per_node)
    group = cl.spec.node_groups[0].name
    inst = [(group, 1)] * cfg.inference.num_servers
    ranks = cfg.trainer.num_ranks
    return inst, TrainerLayout(((group, ranks),), ranks)


def predict_run(
    cfg: ExperimentConfig, plan: Plan | None = None, profile_dir: Path | None = None
) -> dict[str, Any]:
    """The prediction for the run `cfg` describes, in both modes; `{"unavailable": why}`
    when the cost model lacks an input."""
    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.predict import LayoutError, predict_layout
    from scheduler.profile import load_profile
    from scheduler.workload import load_workload

    found = _inputs(cfg, plan, profile_dir)
    if isinstance(found, str):
        return {"unavailable": found}
    cluster, workload, profile, model = found
    try:
        cl = load_cluster(cluster)
        m = load_model_shape(model)
        w = load_workload(workload).model_copy(
            update={
                "groups_per_step": cfg.buffer.groups_per_step,
                "group_size": cfg.rollout.group_size,
                "staleness": cfg.buffer.max_staleness,
                "publish_interval": cfg.trainer.publish_every,
                "max_response_tokens": cfg.rollout.max_new_tokens,
            }
        )
        prof = load_profile(profile, m.params) if profile else None
        inst, trainer = _layout(cfg, plan, cl)
        pred = predict_layout(
            cl, m, w, prof, inst, trainer, max_inflight_groups=cfg.rollout.max_concurrent_groups
        )
    except (ConfigError, LayoutError) as exc:
        return {"unavailable": str(exc)}
    return {
        "source": "plan" if plan is not None else "local profile",
        "cluster": str(cluster),
        "asynchronous": pred.asynchronous.as_dict(),
        "synchronous": pred.synchronous.as_dict(),
    }


def write_prediction(path: Path, prediction: dict[str, Any]) -> None:
    path.write_text(json.dumps(prediction, indent=2))

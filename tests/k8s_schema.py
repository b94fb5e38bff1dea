"""Strict offline validation of rendered Kubernetes objects: built-in kinds with
kubernetes-validate; JobSets against the JobSet CRD's published schema (tests/data,
made strict: unknown fields are errors, as `kubectl apply --validate=strict` makes them),
with their Job template also checked as a batch/v1 Job."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

SCHEMA = Path(__file__).parent / "data/jobset_v1alpha2_schema.json"


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        open_ended = node.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in out and "additionalProperties" not in out and not open_ended:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@cache
def jobset_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strict(json.loads(SCHEMA.read_text())))


def job_of(jobset: dict) -> dict:
    """A JobSet's (single) replicated job as the batch/v1 Job it becomes."""
    (job,) = jobs_of(jobset)
    return job


def jobs_of(jobset: dict) -> list[dict]:
    """Each replicated job of a JobSet as the batch/v1 Job it becomes."""
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": jobset["metadata"],
            "spec": rj["template"]["spec"],
        }
        for rj in jobset["spec"]["replicatedJobs"]
    ]


def validate(obj: dict, version: str) -> str:
    """Raise on any schema violation; returns the Kubernetes version it was checked for."""
    if obj["kind"] == "JobSet":
        errors = sorted(jobset_validator().iter_errors(obj), key=str)
        if errors:
            raise jsonschema.ValidationError(
                "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
            )
        checked = {kubernetes_validate.validate(j, version, strict=True) for j in jobs_of(obj)}
        (found,) = checked
        return found
    return kubernetes_validate.validate(obj, version, strict=True)

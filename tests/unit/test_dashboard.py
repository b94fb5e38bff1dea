"""The shipped Grafana dashboard loads and queries only metrics the services export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from areal_hex.prom import METRIC_NAMES

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "areal-hex.json"
# PromQL words the dashboard uses that are not metric names: functions, `by`, label names.
PROMQL_WORDS = {
    "rate",
    "sum",
    "by",
    "scalar",
    "histogram_quantile",
    "le",
    "phase",
    "server",
    "gpu_kind",
}


def metric_names(expr: str) -> set[str]:
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)  # selectors, ranges, strings
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))
    return words - PROMQL_WORDS


def test_dashboard_references_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["panels"], "no panels"
    used: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, target["expr"]
            used |= names
    assert used <= set(METRIC_NAMES), sorted(used - set(METRIC_NAMES))
    # the panels an operator needs: busy time, step split, version lag, drops, weight sync,
    # gate waits, request latency, server health, tokens/s per GPU kind, predicted rates
    for needed in (
        "areal_hex_rollout_generation_busy_seconds_total",
        "areal_hex_trainer_step_phase_seconds_sum",
        "areal_hex_trainer_step_phase_seconds_bucket",
        "areal_hex_trainer_version_lag_versions_bucket",
        "areal_hex_trainer_groups_dropped_stale_total",
        "areal_hex_trainer_dead_letters_total",
        "areal_hex_rollout_groups_filtered_total",
        "areal_hex_rollout_weight_sync_seconds_total",
        "areal_hex_rollout_gate_wait_seconds_bucket",
        "areal_hex_rollout_request_seconds_bucket",
        "areal_hex_rollout_server_healthy",
        "areal_hex_rollout_server_tokens_total",
        "areal_hex_trainer_tokens_total",
        "areal_hex_trainer_samples_total",
        "areal_hex_predicted_samples_per_second",
        "areal_hex_predicted_generation_samples_per_second",
        "areal_hex_predicted_training_samples_per_second",
        "areal_hex_predicted_weight_sync_seconds",
    ):
        assert needed in used, needed


def test_tokens_per_second_are_split_by_gpu_kind() -> None:
    dash = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dash["panels"] if p["title"] == "Tokens/s per GPU kind"]
    assert all("by (gpu_kind)" in t["expr"] for t in panel["targets"])


def test_the_check_catches_a_misspelt_metric() -> None:
    assert metric_names('rate(areal_hex_trainer_tokenz_total{phase="x"}[5m])') == {
        "areal_hex_trainer_tokenz_total"
    }


def test_every_query_is_filtered_by_the_run_variable() -> None:
    """Runs share a Prometheus: each selector of each panel keeps only the chosen runs
    (`run`, the label the rendered scrape configs attach); "All" also matches series
    without the label."""
    dash = json.loads(DASHBOARD.read_text())
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "run"]
    assert var["includeAll"] and var["allValue"] == ".*" and var["multi"]
    assert "run)" in var["definition"]
    for panel in dash["panels"]:
        for target in panel["targets"]:
            bare = re.sub(r"\"[^\"]*\"", '""', target["expr"])
            for name in metric_names(target["expr"]):
                for m in re.finditer(rf"\b{name}\b(\{{[^}}]*\}})?", bare):
                    assert m.group(1) and 'run=~""' in m.group(1), (panel["title"], name)

"""Prometheus metrics of the trainer, the controller and the buffer, read from the same
typed rows (`run_files.TrainerRow`, `RolloutRow`) and buffer snapshot (`api.BufferStats`)
that the report reads, so a scrape and `metrics.jsonl` cannot disagree.

Each collector reads its source at scrape time and each service owns its registry (no
module-level collectors), as the inference server's `rollout_service/server/metrics.py` does.
Histograms are filled where the event happens: a step row's phases (trainer), a wait at
the staleness gate and each generate request (controller, through its observer lists).
Names follow Prometheus conventions: `areal_hex_<part>_<what>_<unit>`, counters end in
`_total` (the text format adds the suffix), durations in `_seconds`. `METRIC_NAMES` lists
every sample name; docs/observability.md and the Grafana dashboard use only these.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from areal_hex.api import BufferStats
from areal_hex.device_kind import CPU_KIND
from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow

T = "areal_hex_trainer_"
R = "areal_hex_rollout_"
B = "areal_hex_buffer_"
P = "areal_hex_predicted_"

# The phases a trainer step's wall time splits into (TrainerRow fields, seconds).
STEP_PHASES = ("wait", "compute", "publish", "checkpoint")
# Bucket bounds in seconds: step phases and gate waits (ms to minutes), generate requests.
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)


# One unlabelled metric: (name after the prefix, help text, value).
Sample = tuple[str, str, float]


def counters(prefix: str, rows: Iterable[Sample]) -> Iterator[Metric]:
    """A counter family per row (the text format adds `_total` to the name)."""
    for name, doc, value in rows:
        yield CounterMetricFamily(prefix + name, doc, value=value)


def gauges(prefix: str, rows: Iterable[Sample]) -> Iterator[Metric]:
    """A gauge family per row."""
    for name, doc, value in rows:
        yield GaugeMetricFamily(prefix + name, doc, value)


class TrainerCollector(Collector):
    """The trainer's metrics from its latest step row plus the steps seen so far.
    `gpu_kind` labels its token counts; `group_size` turns groups into samples."""

    def __init__(self, gpu_kind: str = CPU_KIND, group_size: int = 1) -> None:
        self.row = TrainerRow()
        self.gpu_kind = gpu_kind
        self.group_size = group_size
        self.version_lag: dict[int, int] = {}  # versions behind -> groups trained
        self.phases = Histogram(
            T + "step_phase_seconds",
            "trainer step wall time by phase",
            ["phase"],
            registry=None,
            buckets=STEP_BUCKETS,
        )

    def observe(self, row: TrainerRow) -> None:
        """Take one step's row (called where the row is appended to metrics.jsonl)."""
        self.row = row
        for phase in STEP_PHASES:
            self.phases.labels(phase).observe(getattr(row, f"{phase}_s"))
        for behind, n in row.version_lag_hist.items():
            self.version_lag[int(behind)] = self.version_lag.get(int(behind), 0) + n

    def collect(self) -> Iterator[Metric]:
        r = self.row
        yield from self.phases.collect()
        yield GaugeMetricFamily(T + "step", "optimizer steps taken", r.step)
        yield GaugeMetricFamily(T + "version", "policy version last published", r.version)
        yield GaugeMetricFamily(T + "loss", "loss of the last step", r.loss)
        kind = [self.gpu_kind]
        tps = GaugeMetricFamily(
            T + "tokens_per_second", "tokens/s of the last step", labels=["gpu_kind"]
        )
        tps.add_metric(kind, r.tokens_per_s)
        yield tps
        tokens = CounterMetricFamily(T + "tokens", "tokens trained", labels=["gpu_kind"])
        tokens.add_metric(kind, r.tokens_total)
        yield tokens
        yield from counters(
            T,
            [
                ("samples", "samples trained", r.groups_trained_total * self.group_size),
                ("groups_trained", "groups trained (acknowledged)", r.groups_trained_total),
                (
                    "groups_dropped_stale",
                    "groups dropped as older than v - eta",
                    r.groups_dropped_stale_total,
                ),
                (
                    "dead_letters",
                    "malformed entries moved to the dead-letter stream",
                    r.dead_letter_total,
                ),
                (
                    "degenerate_groups",
                    "groups trained whose rewards were all equal (zero advantage)",
                    r.degenerate_groups_total,
                ),
            ],
        )
        yield _version_lag_histogram(self.version_lag)
        # PPO's critic (algo.advantage gae): absent from a run without one
        critic = [
            ("value_loss", "critic's value loss of the last step", r.value_loss),
            (
                "explained_variance",
                "1 - Var(R - V) / Var(R) of the critic's values in the last step",
                r.explained_var,
            ),
        ]
        for name, doc, value in critic:
            if value is not None:
                yield GaugeMetricFamily(T + name, doc, value)


def _version_lag_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """Cumulative buckets over versions behind (0, 1, 2, ... up to the largest seen)."""
    top = max(counts, default=0)
    buckets, acc = [], 0
    for le in range(top + 1):
        acc += counts.get(le, 0)
        buckets.append((str(float(le)), acc))
    buckets.append(("+Inf", acc))
    total = float(sum(k * n for k, n in counts.items()))
    return HistogramMetricFamily(
        T + "version_lag_versions",
        "versions a trained group lagged behind the trainer",
        buckets=buckets,
        sum_value=total,
    )


class ServerView(Protocol):
    """What the controller's collector reads of one inference server (the dispatcher's
    `ServerState`), at scrape time."""

    @property
    def url(self) -> str: ...

    index: int
    healthy: bool
    in_flight: int
    requests_total: int
    failures_total: int
    tokens_total: int


class RolloutCollector(Collector):
    """The controller's metrics: its latest `RolloutRow` (totals since start), the
    staleness-gate waits and generate-request latencies it observes, and the live state
    of each inference server, labelled `server` (URL) and `gpu_kind`
    (`inference.gpu_kinds`, "unknown" when not given)."""

    def __init__(self, servers: Sequence[ServerView] = (), gpu_kinds: Sequence[str] = ()) -> None:
        self.row = RolloutRow()
        self.servers = list(servers)
        self.gpu_kinds = list(gpu_kinds)
        self.gate_waits = Histogram(
            R + "gate_wait_seconds",
            "time a prompt waited for the staleness gate (and backpressure)",
            registry=None,
            buckets=STEP_BUCKETS,
        )
        self.requests = Histogram(
            R + "request_seconds",
            "latency of one generate request to an inference server",
            ["server", "gpu_kind"],
            registry=None,
            buckets=REQUEST_BUCKETS,
        )

    def observe(self, row: RolloutRow) -> None:
        self.row = row

    def observe_gate_wait(self, seconds: float) -> None:
        self.gate_waits.observe(seconds)

    def observe_request(self, server: ServerView, seconds: float) -> None:
        self.requests.labels(*self._labels(server)).observe(seconds)

    def _labels(self, server: ServerView) -> list[str]:
        kinds = self.gpu_kinds
        return [server.url, kinds[server.index] if server.index < len(kinds) else "unknown"]

    def collect(self) -> Iterator[Metric]:
        r = self.row
        yield from gauges(
            R,
            [
                ("groups_in_flight", "groups being generated", r.groups_in_flight),
                ("servers_healthy", "inference servers answering health", r.servers_healthy),
                ("version", "policy version the controller generates with", r.version),
                ("tokens_per_second", "generated tokens/s over the last interval", r.tokens_per_s),
                ("reward_mean", "mean reward over the last interval", r.reward_mean or 0.0),
            ],
        )
        yield from counters(
            R,
            [
                ("groups_produced", "groups generated and scored", r.groups_produced_total),
                (
                    "groups_filtered",
                    "groups not buffered: all rewards equal (dynamic sampling)",
                    r.groups_filtered_total,
                ),
                ("groups_failed", "groups that failed", r.groups_failed_total),
                ("samples", "samples generated", r.samples_total),
                ("tokens", "tokens generated", r.tokens_total),
                ("requests", "generate requests sent", r.requests_total),
                ("requests_retried", "generate requests retried", r.requests_retried_total),
                ("weight_syncs", "weight syncs applied", r.weight_syncs_total),
                ("weight_sync_seconds", "time spent in weight syncs", r.weight_sync_s_total),
                ("generation_busy_seconds", "time any server had work", r.gen_busy_s),
                (
                    "context_switches",
                    "colocated: releases of the servers' memory and their resumes",
                    r.context_switches_total,
                ),
                (
                    "context_switch_seconds",
                    "colocated: time the releases and resumes took",
                    r.context_switch_s_total,
                ),
            ],
        )
        yield from self.gate_waits.collect()
        yield from self.requests.collect()
        yield from self._per_server()

    def _per_server(self) -> Iterator[Metric]:
        labels = ["server", "gpu_kind"]
        healthy = GaugeMetricFamily(
            R + "server_healthy", "1 if the server answers health, else 0", labels=labels
        )
        in_flight = GaugeMetricFamily(
            R + "server_requests_in_flight", "requests running on the server", labels=labels
        )
        counters = {
            "requests_total": CounterMetricFamily(
                R + "server_requests", "generate requests sent to the server", labels=labels
            ),
            "failures_total": CounterMetricFamily(
                R + "server_failures", "failed requests and probes of the server", labels=labels
            ),
            "tokens_total": CounterMetricFamily(
                R + "server_tokens", "tokens the server generated", labels=labels
            ),
        }
        for s in self.servers:
            lab = self._labels(s)
            healthy.add_metric(lab, float(s.healthy))
            in_flight.add_metric(lab, s.in_flight)
            for attr, fam in counters.items():
                fam.add_metric(lab, getattr(s, attr))
        yield healthy
        yield in_flight
        yield from counters.values()


class BufferCollector(Collector):
    """The buffer's state, read from Redis (`stats()`, e.g. `buffer.read_stats`) per scrape."""

    def __init__(self, stats: Callable[[], BufferStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield GaugeMetricFamily(
            B + "stream_length", "entries in the trajectory stream", s.stream_length
        )
        yield GaugeMetricFamily(B + "pending", "entries delivered, not yet acknowledged", s.pending)
        yield GaugeMetricFamily(B + "lag", "entries never delivered to the trainer", s.unconsumed)
        yield GaugeMetricFamily(B + "version", "policy version key", s.version)
        yield CounterMetricFamily(
            B + "submitted", "groups admitted by the staleness gate", value=s.submitted
        )
        yield CounterMetricFamily(
            B + "groups_dropped_stale", "groups dropped as too stale", value=s.groups_dropped_stale
        )
        yield CounterMetricFamily(
            B + "dead_letters", "entries in the dead-letter stream", value=s.dead_letter
        )
        back = CounterMetricFamily(
            B + "given_back",
            "admissions given back unput, by reason (filtered: dynamic sampling)",
            labels=["reason"],
        )
        for reason, n in sorted(s.given_back.items()):
            back.add_metric([reason], n)
        yield back


class PredictionCollector(Collector):
    """The cost model's rates for the run (`prediction.json`, which the launcher writes
    from the plan or a local profile; the block of the run's mode), next to which the
    dashboard draws the measured ones, defined alike (`hexctl/report/fidelity.py`)."""

    def __init__(self, predicted: dict[str, float | None]) -> None:
        self.predicted = predicted

    def collect(self) -> Iterator[Metric]:
        gauges = [
            ("samples_per_second", "pipeline_samples_per_s", "trained samples/s of wall time"),
            (
                "generation_samples_per_second",
                "generation_samples_per_s",
                "samples/s of server busy time",
            ),
            (
                "training_samples_per_second",
                "training_samples_per_s",
                "samples/s of trainer compute + publish time",
            ),
            ("weight_sync_seconds", "weight_sync_s", "pause per weight update"),
        ]
        for name, key, doc in gauges:
            value = self.predicted.get(key)
            if value is not None:
                yield GaugeMetricFamily(P + name, "predicted " + doc, value)


def prediction_collectors(run_dir: Path, mode: str) -> list[Collector]:
    """The run's predicted rates (`mode`: "async" or "sync") when the launcher wrote a
    prediction; none otherwise (no plan and no profile, or the model lacked an input)."""
    path = RunPaths.at(run_dir).prediction
    if not path.is_file():
        return []
    prediction = json.loads(path.read_text())
    block = prediction.get("synchronous" if mode == "sync" else "asynchronous")
    return [PredictionCollector(block)] if isinstance(block, dict) else []


def registry_with(*collectors: Collector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    for c in collectors:
        reg.register(c)
    return reg


def _names(
    prefix: str, gauges: list[str], counters: list[str], hists: Sequence[str] = ()
) -> list[str]:
    out = [prefix + g for g in gauges] + [prefix + c + "_total" for c in counters]
    return out + [prefix + h + s for h in hists for s in ("_bucket", "_sum", "_count")]


# Every sample name a scrape carries (counters with their `_total` suffix, histograms as
# their `_bucket`, `_sum` and `_count`).
TRAINER_NAMES: tuple[str, ...] = tuple(
    _names(
        T,
        ["step", "version", "tokens_per_second", "loss"],
        ["tokens", "samples", "groups_trained", "groups_dropped_stale", "dead_letters"]
        + ["degenerate_groups"],
        ["step_phase_seconds", "version_lag_versions"],
    )
)
ROLLOUT_NAMES: tuple[str, ...] = tuple(
    _names(
        R,
        ["groups_in_flight", "servers_healthy", "version", "tokens_per_second", "reward_mean"]
        + ["server_healthy", "server_requests_in_flight"],
        ["groups_produced", "groups_filtered", "groups_failed", "samples", "tokens"]
        + ["requests", "requests_retried", "weight_syncs", "weight_sync_seconds"]
        + ["generation_busy_seconds", "server_requests", "server_failures", "server_tokens"]
        + ["context_switches", "context_switch_seconds"],
        ["gate_wait_seconds", "request_seconds"],
    )
)
BUFFER_NAMES: tuple[str, ...] = tuple(
    _names(
        B,
        ["stream_length", "pending", "lag", "version"],
        ["submitted", "groups_dropped_stale", "dead_letters", "given_back"],
    )
)
# Only where the launcher wrote a prediction (`prediction.json`): the trainer serves them.
PREDICTED_NAMES: tuple[str, ...] = tuple(
    _names(
        P,
        ["samples_per_second", "generation_samples_per_second"]
        + ["training_samples_per_second", "weight_sync_seconds"],
        [],
    )
)
METRIC_NAMES: tuple[str, ...] = TRAINER_NAMES + ROLLOUT_NAMES + BUFFER_NAMES + PREDICTED_NAMES


# ---------------------------------------------------------------- the /metrics endpoint
class MetricsServer:
    """`GET /metrics` of one registry on its own port, in a daemon thread; with a token,
    every request must carry `Authorization: Bearer <token>` (as the services' routes do)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "0.0.0.0",
        token: str | None = None,
    ) -> None:
        self._httpd = make_server(host, port, _app(registry, token), handler_class=_QuietHandler)
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _app(registry: CollectorRegistry, token: str | None) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if token is not None:
            scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip(), token):
                start_response("401 Unauthorized", [("Content-Type", "text/plain")])
                return [b"missing or invalid token (expected 'Authorization: Bearer ...')\n"]
        return metrics(environ, start_response)

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        pass  # one line per scrape would flood the service's log

"""Prometheus metrics of the trainer, the controller and the buffer, read from the same
typed rows (`run_files.TrainerRow`, `RolloutRow`) and buffer snapshot (`api.BufferStats`)
that the report reads, so a scrape and `metrics.jsonl` cannot disagree.

Each collector reads its source at scrape time and each service owns its registry (no
module-level collectors), as the inference server's `rollout_service/metrics.py` does.
Names follow Prometheus conventions: `areal_hex_<part>_<what>_<unit>`, counters end in
`_total` (the text format adds the suffix), durations in `_seconds`. `METRIC_NAMES` lists
every family; docs/observability.md and the Grafana dashboard use only these.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from areal_hex.api import BufferStats
from areal_hex.run_files import RolloutRow, TrainerRow

T = "areal_hex_trainer_"
R = "areal_hex_rollout_"
B = "areal_hex_buffer_"

# The phases a trainer step's wall time splits into (TrainerRow fields, seconds).
STEP_PHASES = ("wait", "compute", "publish", "checkpoint")


class TrainerCollector(Collector):
    """The trainer's metrics from its latest step row plus the steps seen so far."""

    def __init__(self) -> None:
        self.row = TrainerRow()
        self.phase_s = dict.fromkeys(STEP_PHASES, 0.0)
        self.staleness: dict[int, int] = {}  # versions behind -> groups trained

    def observe(self, row: TrainerRow) -> None:
        """Take one step's row (called where the row is appended to metrics.jsonl)."""
        self.row = row
        for phase in STEP_PHASES:
            self.phase_s[phase] += getattr(row, f"{phase}_s")
        for behind, n in row.staleness_hist.items():
            self.staleness[int(behind)] = self.staleness.get(int(behind), 0) + n

    def collect(self) -> Iterator[Metric]:
        r = self.row
        steps = CounterMetricFamily(
            T + "step_phase_seconds", "trainer wall time by step phase", labels=["phase"]
        )
        for phase, s in self.phase_s.items():
            steps.add_metric([phase], s)
        yield steps
        yield GaugeMetricFamily(T + "step", "optimizer steps taken", r.step)
        yield GaugeMetricFamily(T + "version", "policy version last published", r.version)
        yield GaugeMetricFamily(
            T + "tokens_per_second", "tokens/s of the last step", r.tokens_per_s
        )
        yield GaugeMetricFamily(T + "loss", "loss of the last step", r.loss)
        counters = [
            ("tokens", "tokens trained", r.tokens_total),
            ("groups_trained", "groups trained (acknowledged)", r.groups_trained_total),
            ("dropped_stale", "groups dropped as older than v - eta", r.dropped_stale_total),
            (
                "dead_letters",
                "malformed entries moved to the dead-letter stream",
                r.dead_letter_total,
            ),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(T + name, doc, value=value)
        yield _staleness_histogram(self.staleness)


def _staleness_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """Cumulative buckets over versions behind (0, 1, 2, ... up to the largest seen)."""
    top = max(counts, default=0)
    buckets, acc = [], 0
    for le in range(top + 1):
        acc += counts.get(le, 0)
        buckets.append((str(float(le)), acc))
    buckets.append(("+Inf", acc))
    total = float(sum(k * n for k, n in counts.items()))
    return HistogramMetricFamily(
        T + "staleness_versions",
        "versions a trained group lagged behind the trainer",
        buckets=buckets,
        sum_value=total,
    )


class RolloutCollector(Collector):
    """The controller's metrics from its latest `RolloutRow` (totals since start)."""

    def __init__(self) -> None:
        self.row = RolloutRow()

    def observe(self, row: RolloutRow) -> None:
        self.row = row

    def collect(self) -> Iterator[Metric]:
        r = self.row
        gauges = [
            ("groups_in_flight", "groups being generated", r.groups_in_flight),
            ("servers_healthy", "inference servers answering health", r.servers_healthy),
            ("version", "policy version the controller generates with", r.version),
            ("tokens_per_second", "generated tokens/s over the last interval", r.tokens_per_s),
            ("reward_mean", "mean reward over the last interval", r.reward_mean or 0.0),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(R + name, doc, value)
        counters = [
            ("groups_produced", "groups written to the buffer", r.groups_produced_total),
            ("groups_failed", "groups that failed", r.groups_failed_total),
            ("samples", "samples generated", r.samples_total),
            ("tokens", "tokens generated", r.tokens_total),
            ("requests", "generate requests sent", r.requests_total),
            ("requests_retried", "generate requests retried", r.requests_retried_total),
            ("weight_updates", "weight updates applied", r.weight_updates_total),
            ("weight_update_seconds", "time spent in weight updates", r.weight_update_s_total),
            ("generation_busy_seconds", "time any server had work", r.gen_busy_s),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(R + name, doc, value=value)


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
            B + "dropped_stale", "groups dropped as too stale", value=s.dropped_stale
        )
        yield CounterMetricFamily(
            B + "dead_letters", "entries in the dead-letter stream", value=s.dead_letter
        )


def registry_with(*collectors: Collector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    for c in collectors:
        reg.register(c)
    return reg


def _names(prefix: str, gauges: list[str], counters: list[str]) -> list[str]:
    return [prefix + g for g in gauges] + [prefix + c + "_total" for c in counters]


# Every sample name a scrape carries (counters with their `_total` suffix).
METRIC_NAMES: tuple[str, ...] = tuple(
    _names(
        T,
        ["step", "version", "tokens_per_second", "loss"],
        ["step_phase_seconds", "tokens", "groups_trained", "dropped_stale", "dead_letters"],
    )
    + [
        T + "staleness_versions_bucket",
        T + "staleness_versions_sum",
        T + "staleness_versions_count",
    ]
    + _names(
        R,
        ["groups_in_flight", "servers_healthy", "version", "tokens_per_second", "reward_mean"],
        [
            "groups_produced",
            "groups_failed",
            "samples",
            "tokens",
            "requests",
            "requests_retried",
            "weight_updates",
            "weight_update_seconds",
            "generation_busy_seconds",
        ],
    )
    + _names(
        B,
        ["stream_length", "pending", "lag", "version"],
        ["submitted", "dropped_stale", "dead_letters"],
    )
)


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

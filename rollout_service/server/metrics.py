"""Prometheus metrics of one server, read from the engine at scrape time.

Each app owns its registry (no module-level collectors), so several servers can live in
one process (tests) without clashing. Names follow SGLang's (`sglang:` prefix) so the
same dashboards read either server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from areal_hex.prom import counters, gauges

if TYPE_CHECKING:
    from rollout_service.server.engine import Engine

P = "sglang:"


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield from gauges(
            P,
            [
                ("num_running_reqs", "requests in the running batch", s.running),
                ("num_queue_reqs", "requests waiting for a batch slot", s.waiting),
                ("gen_throughput", "generated tokens per second", s.gen_throughput),
                ("is_paused", "1 while generation is paused", int(s.paused)),
            ],
        )
        version = GaugeMetricFamily(
            P + "weight_version", "loaded weight version (numeric part)", labels=["version"]
        )
        version.add_metric([s.weight_version], _numeric(s.weight_version))
        yield version
        yield from counters(
            P,
            [
                ("generation_tokens", "tokens generated", s.generation_tokens_total),
                ("prompt_tokens", "prompt tokens prefilled", s.prompt_tokens_total),
                ("num_requests", "requests received", s.requests_total),
                ("num_aborted_requests", "requests that ended aborted", s.aborted_total),
                ("weight_updates", "weight reloads completed", s.weight_updates_total),
                (
                    "prefill_batches",
                    "prefill forwards (new requests joining)",
                    s.prefill_batches_total,
                ),
                ("decode_steps", "decode forwards of the running batch", s.decode_steps_total),
            ],
        )


def _numeric(version: str) -> float:
    digits = version.lstrip("vV")
    try:
        return float(digits)
    except ValueError:
        return -1.0


def build_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine))
    return registry

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from areal_hex.buffer.consumer import ensure_group, read_stats
from areal_hex.buffer.embedded import EmbeddedValkey
from areal_hex.buffer.keys import GROUP, PAYLOAD_FIELD, BufferKeys
from areal_hex.prom import (
    METRIC_NAMES,
    BufferCollector,
    MetricsServer,
    RolloutCollector,
    TrainerCollector,
    registry_with,
)
from areal_hex.run_files import RolloutRow, TrainerRow


def scrape(*collectors: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse a scrape with prometheus_client's own text parser: sample -> value."""
    text = generate_latest(registry_with(*collectors)).decode()  # type: ignore[arg-type]
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def test_trainer_metrics_equal_the_rows() -> None:
    c = TrainerCollector()
    c.observe(
        TrainerRow(
            step=1,
            version=1,
            wait_s=0.5,
            compute_s=2.0,
            tokens_total=100,
            staleness_hist={"0": 3, "2": 1},
            dropped_stale_total=1,
        )
    )
    c.observe(
        TrainerRow(
            step=2,
            version=2,
            wait_s=0.25,
            compute_s=1.0,
            publish_s=0.5,
            tokens_total=250,
            staleness_hist={"1": 4},
            dropped_stale_total=3,
            dead_letter_total=2,
            tokens_per_s=150.0,
        )
    )
    s = scrape(c)
    assert s[("areal_hex_trainer_step_phase_seconds_total", (("phase", "wait"),))] == 0.75
    assert s[("areal_hex_trainer_step_phase_seconds_total", (("phase", "compute"),))] == 3.0
    assert s[("areal_hex_trainer_step_phase_seconds_total", (("phase", "publish"),))] == 0.5
    assert s[("areal_hex_trainer_tokens_total", ())] == 250  # the row's running total
    assert s[("areal_hex_trainer_dropped_stale_total", ())] == 3
    assert s[("areal_hex_trainer_dead_letters_total", ())] == 2
    assert s[("areal_hex_trainer_version", ())] == 2
    assert s[("areal_hex_trainer_tokens_per_second", ())] == 150.0
    # staleness over both steps: 3 groups at 0, 4 at 1, 1 at 2 (cumulative buckets)
    h = "areal_hex_trainer_staleness_versions_bucket"
    assert s[(h, (("le", "0.0"),))] == 3
    assert s[(h, (("le", "1.0"),))] == 7
    assert s[(h, (("le", "2.0"),))] == 8
    assert s[(h, (("le", "+Inf"),))] == 8
    assert s[("areal_hex_trainer_staleness_versions_sum", ())] == 4 + 2
    assert s[("areal_hex_trainer_staleness_versions_count", ())] == 8


def test_rollout_metrics_equal_the_row() -> None:
    c = RolloutCollector()
    c.observe(
        RolloutRow(
            groups_produced_total=12,
            groups_in_flight=3,
            servers_healthy=2,
            tokens_total=900,
            weight_update_s_total=1.5,
            reward_mean=0.25,
        )
    )
    s = scrape(c)
    assert s[("areal_hex_rollout_groups_produced_total", ())] == 12
    assert s[("areal_hex_rollout_groups_in_flight", ())] == 3
    assert s[("areal_hex_rollout_servers_healthy", ())] == 2
    assert s[("areal_hex_rollout_tokens_total", ())] == 900
    assert s[("areal_hex_rollout_weight_update_seconds_total", ())] == 1.5
    assert s[("areal_hex_rollout_reward_mean", ())] == 0.25


@pytest.fixture
def valkey() -> Iterator[redis.Redis]:
    server = EmbeddedValkey(appendonly=False).start()
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def test_buffer_metrics_read_redis(valkey: redis.Redis) -> None:
    keys = BufferKeys("r")
    ensure_group(valkey, keys)
    for _ in range(3):
        valkey.xadd(keys.traj, {PAYLOAD_FIELD: b"x"})
    valkey.xreadgroup(GROUP, "c0", {keys.traj: ">"}, count=1)  # one delivered, not acked
    valkey.set(keys.dropped_stale, 4)
    s = scrape(BufferCollector(lambda: read_stats(valkey, keys)))
    assert s[("areal_hex_buffer_stream_length", ())] == 3
    assert s[("areal_hex_buffer_pending", ())] == 1
    assert s[("areal_hex_buffer_lag", ())] == 2
    assert s[("areal_hex_buffer_dropped_stale_total", ())] == 4


def test_every_listed_name_is_scraped_and_nothing_else() -> None:
    from areal_hex.api import BufferStats

    stats = BufferStats(0, 0, 0, 0, 0, 0, 0)
    trainer = TrainerCollector()
    trainer.observe(TrainerRow(staleness_hist={"1": 1}))
    s = scrape(trainer, RolloutCollector(), BufferCollector(lambda: stats))
    scraped = {n for n in names(s) if not n.endswith("_created")}
    assert scraped == set(METRIC_NAMES)


def test_metrics_endpoint_requires_the_token() -> None:
    c = RolloutCollector()
    c.observe(RolloutRow(groups_produced_total=5))
    server = MetricsServer(registry_with(c), port=0, host="127.0.0.1", token="s3cret")
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 401
        req = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.stop()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["areal_hex_rollout_groups_produced"].samples[0].value == 5


class _TrainerSide:
    """What `serve_metrics` uses of the trainer: its row observers and rank 0's source."""

    def __init__(self, consumer: object) -> None:
        self.row_observers: list = []
        self.consumer = consumer


def test_trainer_service_serves_its_rows_and_the_buffer(valkey: redis.Redis) -> None:
    from areal_hex.config import load_config
    from trainer_service.main import serve_metrics
    from trainer_service.sources import BufferSource

    port = valkey.connection_pool.connection_kwargs["port"]
    cfg = load_config(
        None, ["run.run_id=r", f"redis.url=redis://127.0.0.1:{port}/0", "trainer.metrics_port=0"]
    )
    source = BufferSource(cfg.redis, cfg.buffer, "r")
    valkey.xadd(BufferKeys("r").traj, {PAYLOAD_FIELD: b"x"})
    side = _TrainerSide(source)
    server = serve_metrics(cfg, side)  # type: ignore[arg-type]
    assert server is not None
    try:
        for observe in side.row_observers:  # as Trainer.step does after writing the row
            observe(TrainerRow(step=3, tokens_total=42))
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.stop()
        source.close()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["areal_hex_trainer_step"] == 3
    assert got["areal_hex_trainer_tokens_total"] == 42
    assert got["areal_hex_buffer_stream_length"] == 1
    assert serve_metrics(load_config(None, []), side) is None  # off by default

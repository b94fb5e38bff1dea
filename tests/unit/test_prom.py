from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fakes import TOK, FakeServer, MemoryProducer
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
    prediction_collectors,
    registry_with,
)
from areal_hex.run_files import RolloutRow, TrainerRow
from rollout_service.controller.dispatch import ServerState
from scheduler.predict import LayoutRates


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
    c = TrainerCollector(gpu_kind="H800", group_size=4)
    c.observe(
        TrainerRow(
            step=1,
            version=1,
            wait_s=0.5,
            compute_s=2.0,
            tokens_total=100,
            groups_trained_total=2,
            version_lag_hist={"0": 3, "2": 1},
            groups_dropped_stale_total=1,
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
            groups_trained_total=4,
            version_lag_hist={"1": 4},
            groups_dropped_stale_total=3,
            dead_letter_total=2,
            degenerate_groups_total=1,
            tokens_per_s=150.0,
        )
    )
    s = scrape(c)
    # the step split: one observation per phase per step, summing to the rows' seconds
    ph = "areal_hex_trainer_step_phase_seconds"
    assert s[(ph + "_sum", (("phase", "wait"),))] == 0.75
    assert s[(ph + "_sum", (("phase", "compute"),))] == 3.0
    assert s[(ph + "_sum", (("phase", "publish"),))] == 0.5
    assert s[(ph + "_sum", (("phase", "checkpoint"),))] == 0.0
    assert s[(ph + "_count", (("phase", "checkpoint"),))] == 2
    assert s[(ph + "_bucket", (("le", "0.25"), ("phase", "wait")))] == 1  # 0.25 s, not 0.5
    assert s[(ph + "_bucket", (("le", "0.5"), ("phase", "wait")))] == 2
    assert s[(ph + "_bucket", (("le", "1.0"), ("phase", "compute")))] == 1
    kind = (("gpu_kind", "H800"),)
    assert s[("areal_hex_trainer_tokens_total", kind)] == 250  # the row's running total
    assert s[("areal_hex_trainer_tokens_per_second", kind)] == 150.0
    assert s[("areal_hex_trainer_samples_total", ())] == 4 * 4  # groups x group size
    assert s[("areal_hex_trainer_groups_dropped_stale_total", ())] == 3
    assert s[("areal_hex_trainer_dead_letters_total", ())] == 2
    assert s[("areal_hex_trainer_degenerate_groups_total", ())] == 1
    assert s[("areal_hex_trainer_version", ())] == 2
    # staleness over both steps: 3 groups at 0, 4 at 1, 1 at 2 (cumulative buckets)
    h = "areal_hex_trainer_version_lag_versions_bucket"
    assert s[(h, (("le", "0.0"),))] == 3
    assert s[(h, (("le", "1.0"),))] == 7
    assert s[(h, (("le", "2.0"),))] == 8
    assert s[(h, (("le", "+Inf"),))] == 8
    assert s[("areal_hex_trainer_version_lag_versions_sum", ())] == 4 + 2
    assert s[("areal_hex_trainer_version_lag_versions_count", ())] == 8


def servers() -> list[ServerState]:
    return [ServerState(0, FakeServer("http://a:1")), ServerState(1, FakeServer("http://b:2"))]


def test_rollout_metrics_equal_the_row_and_the_servers() -> None:
    a, b = servers()
    a.healthy, a.requests_total, a.tokens_total, a.in_flight = True, 7, 120, 2
    b.failures_total = 3
    c = RolloutCollector([a, b], gpu_kinds=["H20"])  # no kind given for the second one
    c.observe(
        RolloutRow(
            groups_produced_total=12,
            groups_filtered_total=2,
            groups_in_flight=3,
            servers_healthy=1,
            tokens_total=900,
            weight_sync_s_total=1.5,
            reward_mean=0.25,
            context_switches_total=4,
            context_switch_s_total=0.04,
        )
    )
    for wait in (0.0, 0.02, 3.0):
        c.observe_gate_wait(wait)
    c.observe_request(a, 0.3)
    c.observe_request(a, 7.0)
    c.observe_request(b, 0.04)
    s = scrape(c)
    assert s[("areal_hex_rollout_groups_produced_total", ())] == 12
    assert s[("areal_hex_rollout_groups_filtered_total", ())] == 2
    assert s[("areal_hex_rollout_groups_in_flight", ())] == 3
    assert s[("areal_hex_rollout_tokens_total", ())] == 900
    assert s[("areal_hex_rollout_weight_sync_seconds_total", ())] == 1.5
    assert s[("areal_hex_rollout_context_switches_total", ())] == 4
    assert s[("areal_hex_rollout_context_switch_seconds_total", ())] == 0.04
    assert s[("areal_hex_rollout_reward_mean", ())] == 0.25
    g = "areal_hex_rollout_gate_wait_seconds"
    assert s[(g + "_count", ())] == 3 and s[(g + "_sum", ())] == pytest.approx(3.02)
    assert s[(g + "_bucket", (("le", "0.05"),))] == 2
    la = (("gpu_kind", "H20"), ("server", "http://a:1"))
    lb = (("gpu_kind", "unknown"), ("server", "http://b:2"))
    q = "areal_hex_rollout_request_seconds"
    assert s[(q + "_count", la)] == 2 and s[(q + "_sum", la)] == pytest.approx(7.3)
    assert s[(q + "_bucket", (("gpu_kind", "H20"), ("le", "5.0"), ("server", "http://a:1")))] == 1
    assert s[(q + "_count", lb)] == 1
    assert s[("areal_hex_rollout_server_healthy", la)] == 1
    assert s[("areal_hex_rollout_server_healthy", lb)] == 0
    assert s[("areal_hex_rollout_server_requests_in_flight", la)] == 2
    assert s[("areal_hex_rollout_server_requests_total", la)] == 7
    assert s[("areal_hex_rollout_server_tokens_total", la)] == 120
    assert s[("areal_hex_rollout_server_failures_total", lb)] == 3


@pytest.mark.timeout(60)
async def test_controller_feeds_the_histograms(tmp_path: Path) -> None:
    """A real controller (fake servers, in-memory gate) wired as `serve_metrics` does:
    every admission is one gate wait, every HTTP request one latency, and the servers'
    token counts add up to the controller's."""
    from areal_hex.config import DataConfig, ExperimentConfig, RolloutConfig
    from areal_hex.data import build_prompts, generate_arithmetic
    from rollout_service.controller.rollout import RolloutController
    from rollout_service.controller.wiring import serve_metrics

    rollout = RolloutConfig(group_size=3, max_new_tokens=16, metrics_interval_s=0.2)
    prompts = build_prompts(generate_arithmetic(8, "train"), TOK, DataConfig()).prompts
    fakes = [FakeServer("http://a:1"), FakeServer("http://b:2")]
    ctl = RolloutController(
        fakes,
        MemoryProducer(groups_per_step=2, eta=100),
        prompts,
        lambda ids: TOK.decode(ids, skip_special_tokens=True),
        rollout,
        max_groups=6,
        metrics_path=tmp_path / "rollout.jsonl",
    )
    cfg = ExperimentConfig.model_validate(
        {"rollout": {"metrics_port": 0}, "inference": {"gpu_kinds": ["H20", "L40S"]}}
    )
    server = serve_metrics(cfg, ctl)
    assert server is not None
    try:
        final = await ctl.run()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.stop()
    got: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if not smp.name.endswith("_bucket"):
                got[smp.name] = got.get(smp.name, 0.0) + smp.value  # summed over labels
    assert got["areal_hex_rollout_gate_wait_seconds_count"] == 6
    # one latency per HTTP call: here one batched call per group (G samples, G rids)
    calls = sum(fake.batch_calls for fake in fakes)
    assert got["areal_hex_rollout_request_seconds_count"] == calls == 6
    assert got["areal_hex_rollout_server_requests_total"] == calls
    assert got["areal_hex_rollout_server_tokens_total"] == final["tokens_total"] > 0
    assert got["areal_hex_rollout_server_healthy"] == 2
    kinds = {
        s.labels["gpu_kind"]
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "areal_hex_rollout_server_tokens_total"
    }
    assert kinds == {"H20", "L40S"}


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
    valkey.set(keys.groups_dropped_stale, 4)
    valkey.set(keys.given_back("filtered"), 5)
    s = scrape(BufferCollector(lambda: read_stats(valkey, keys)))
    assert s[("areal_hex_buffer_stream_length", ())] == 3
    assert s[("areal_hex_buffer_pending", ())] == 1
    assert s[("areal_hex_buffer_lag", ())] == 2
    assert s[("areal_hex_buffer_groups_dropped_stale_total", ())] == 4
    assert s[("areal_hex_buffer_given_back_total", (("reason", "filtered"),))] == 5
    assert s[("areal_hex_buffer_given_back_total", (("reason", "failed"),))] == 0


# prediction.json as the launcher writes it (hexctl/job/predict.py: the cost model's
# LayoutRates of both modes)
PREDICTION = {
    "source": "plan",
    "cluster": "examples/clusters/h800_h20.yaml",
    "asynchronous": LayoutRates(41.5, 60.0, 41.5, 2.25).as_dict(),
    "synchronous": LayoutRates(20.0, 60.0, 41.5, 2.25).as_dict(),
}


def test_every_listed_name_is_scraped_and_nothing_else(tmp_path: Path) -> None:
    from areal_hex.api import BufferStats

    stats = BufferStats(0, 0, 0, 0, 0, 0, 0, {"filtered": 0})
    trainer = TrainerCollector()
    trainer.observe(TrainerRow(version_lag_hist={"1": 1}))
    rollout = RolloutCollector(servers())
    rollout.observe_gate_wait(0.1)
    rollout.observe_request(rollout.servers[0], 0.1)
    (tmp_path / "prediction.json").write_text(json.dumps(PREDICTION))
    (predicted,) = prediction_collectors(tmp_path, "async")
    s = scrape(trainer, rollout, BufferCollector(lambda: stats), predicted)
    scraped = {n for n in names(s) if not n.endswith("_created")}
    assert scraped == set(METRIC_NAMES)


def test_predicted_rates_of_the_runs_mode_and_only_when_predicted(tmp_path: Path) -> None:
    assert prediction_collectors(tmp_path, "async") == []  # no prediction written
    path = tmp_path / "prediction.json"
    path.write_text(json.dumps({"unavailable": "no plan and no local profile"}))
    assert prediction_collectors(tmp_path, "async") == []
    path.write_text(json.dumps(PREDICTION))
    (sync,) = prediction_collectors(tmp_path, "sync")
    s = scrape(sync)
    assert s[("areal_hex_predicted_samples_per_second", ())] == 20.0
    assert s[("areal_hex_predicted_generation_samples_per_second", ())] == 60.0
    assert s[("areal_hex_predicted_weight_sync_seconds", ())] == 2.25
    partial = {"asynchronous": {"pipeline_samples_per_s": 5.0, "weight_sync_s": None}}
    path.write_text(json.dumps(partial))
    (asyn,) = prediction_collectors(tmp_path, "async")
    assert names(scrape(asyn)) == {"areal_hex_predicted_samples_per_second"}


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
    assert "areal_hex_predicted_samples_per_second" not in got  # no prediction.json
    assert got["areal_hex_buffer_stream_length"] == 1
    assert serve_metrics(load_config(None, []), side) is None  # off by default


def test_names_follow_prometheus_conventions(tmp_path: Path) -> None:
    """`areal_hex_<part>_<what>_<unit>`: counters `_total`, times `_seconds`, rates
    `_per_second`, and no gauge that looks like a counter."""
    from areal_hex.api import BufferStats

    trainer = TrainerCollector()
    trainer.observe(TrainerRow(version_lag_hist={"0": 1}))
    rollout = RolloutCollector(servers())
    rollout.observe_request(rollout.servers[0], 0.1)
    (tmp_path / "prediction.json").write_text(json.dumps(PREDICTION))
    (predicted,) = prediction_collectors(tmp_path, "async")
    stats = BufferStats(0, 0, 0, 0, 0, 0, 0, {"filtered": 0})
    registry = registry_with(trainer, rollout, BufferCollector(lambda: stats), predicted)
    text = generate_latest(registry).decode()
    for fam in text_string_to_metric_families(text):
        assert re.fullmatch(r"areal_hex_(trainer|rollout|buffer|predicted)_[a-z0-9_]+", fam.name)
        assert "_s_" not in fam.name + "_" and not fam.name.endswith("_per_s"), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples)
        if fam.type == "gauge":
            assert not fam.name.endswith("_total"), fam.name
        if fam.type == "histogram":
            assert fam.name.endswith(("_seconds", "_versions")), fam.name


def test_critic_gauges_only_with_a_critic() -> None:
    c = TrainerCollector()
    c.observe(TrainerRow(step=1))
    assert not {"areal_hex_trainer_value_loss", "areal_hex_trainer_explained_variance"} & names(
        scrape(c)
    )
    c.observe(TrainerRow(step=2, value_loss=0.25, explained_var=-0.5))
    s = scrape(c)
    assert s[("areal_hex_trainer_value_loss", ())] == 0.25
    assert s[("areal_hex_trainer_explained_variance", ())] == -0.5

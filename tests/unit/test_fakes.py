"""Each fake (and each real implementation) offers everything its Protocol declares."""

from __future__ import annotations

from fakes import FakeServer, MemoryProducer, RecordingPublisher, missing

from areal_hex.api import GenerationClient, TrajectoryProducer, TrajectorySource, WeightPublisher


def test_fakes_implement_their_whole_protocol() -> None:
    assert missing(FakeServer("s"), GenerationClient) == []
    assert missing(MemoryProducer(), TrajectoryProducer) == []
    assert missing(RecordingPublisher(), WeightPublisher) == []


def test_real_parts_implement_their_whole_protocol() -> None:
    from areal_hex.buffer.consumer import RedisWeightPublisher
    from areal_hex.buffer.producer import RedisTrajectoryProducer
    from rollout_service.client import InferenceClient
    from trainer_service.sources import BufferSource, ReplayConsumer

    assert missing(InferenceClient("http://127.0.0.1:1"), GenerationClient) == []
    for cls, proto in [
        (RedisTrajectoryProducer, TrajectoryProducer),
        (RedisWeightPublisher, WeightPublisher),
        (BufferSource, TrajectorySource),
        (ReplayConsumer, TrajectorySource),
    ]:
        absent = [n for n in missing(cls, proto) if n not in getattr(cls, "__annotations__", {})]
        assert absent == [], (cls.__name__, absent)


def test_missing_names_what_is_absent() -> None:
    class Half:
        base_url = "x"

        async def generate(self, *a: object) -> None: ...

    assert "generate_batch" in missing(Half(), GenerationClient)
    assert "generate" not in missing(Half(), GenerationClient)

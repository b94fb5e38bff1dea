"""The built-in server in reward-model mode (`areal-hex serve --reward-model`, SGLang's
`--is-embedding`): a sequence classifier behind SGLang's `/classify` (and `/encode`,
the same route there), with health, model and server info and metrics. Generation
routes answer 400 naming the mode. Shapes: rollout_service/classify_wire.py; contract
and differences from SGLang: docs/api.md, "Reward models".

    app = create_reward_app(Classifier(model, tok, path), ServerSettings(...))
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from areal_hex.gc_freeze import freeze_startup
from rollout_service.classify_wire import ClassifyInfo, ClassifyMeta, ClassifyOut, ClassifyReq
from rollout_service.server.app import SERVER_VERSION, ServerSettings, guarded
from rollout_service.server.classifier import Classifier
from rollout_service.server.http_common import error

# Routes a generation server has and a reward-model server refuses (SGLang's answer too).
GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def create_reward_app(classifier: Classifier, settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.classifier = classifier
        app.state.settings = settings
        app.state.registry = CollectorRegistry(auto_describe=True)
        app.state.registry.register(ClassifierCollector(classifier))
        freeze_startup()
        yield

    app = guarded(FastAPI(title="areal-hex reward-model server", lifespan=lifespan), settings)
    add_classify_routes(app)
    _info_routes(app)
    return app


def add_classify_routes(app: FastAPI) -> None:
    async def classify(body: ClassifyReq, request: Request) -> Any:
        """SGLang's answer: one object for one input, a list for a batch."""
        clf: Classifier = request.app.state.classifier
        t0 = time.monotonic()
        scored = await clf.classify(body.inputs())
        latency = time.monotonic() - t0
        rids = body.rids() or [uuid.uuid4().hex for _ in scored]
        out = [
            ClassifyOut(
                embedding=scores,
                meta_info=ClassifyMeta(
                    id=rid,
                    finish_reason={"type": "length", "length": 0},
                    prompt_tokens=n,
                    weight_version=clf.weight_version,
                    e2e_latency=latency,
                ),
            ).model_dump()
            for (scores, n), rid in zip(scored, rids, strict=True)
        ]
        return out if body.is_batch else out[0]

    for path in ("/classify", "/encode"):
        app.add_api_route(path, classify, methods=["POST", "PUT"])

    async def not_here(request: Request) -> JSONResponse:
        return error(
            f"{request.url.path}: this server serves a reward model (--reward-model, "
            "SGLang's --is-embedding), which generates nothing; use /classify",
            400,
        )

    for path in GENERATION_ROUTES:
        app.add_api_route(path, not_here, methods=["POST"])


def _info_routes(app: FastAPI) -> None:
    @app.get("/health")
    @app.get("/health_generate")
    async def health(request: Request) -> Response:
        """SGLang's health check of an embedding model runs one token through it."""
        clf: Classifier = request.app.state.classifier
        if request.url.path == "/health_generate":
            await clf.classify([[0]])
        return Response(status_code=200 if clf.alive() else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info(request: Request) -> dict:
        clf: Classifier = request.app.state.classifier
        archs = getattr(clf.model.config, "architectures", None) or [type(clf.model).__name__]
        return ClassifyInfo(
            model_path=clf.model_path,
            tokenizer_path=request.app.state.settings.tokenizer_path,
            weight_version=clf.weight_version,
            num_labels=clf.num_labels,
            architectures=list(archs),
        ).model_dump()

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info(request: Request) -> dict:
        clf: Classifier = request.app.state.classifier
        return {
            **request.app.state.settings.server_args,
            "version": SERVER_VERSION,
            "is_embedding": True,
            "model_path": clf.model_path,
            "weight_version": clf.weight_version,
            "context_length": clf.context_length,
            "max_batch": clf.max_batch,
            "time": time.time(),
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        data = generate_latest(request.app.state.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


class ClassifierCollector(Collector):
    """The classifier's counters, read at scrape time."""

    def __init__(self, classifier: Classifier) -> None:
        self.clf = classifier

    def collect(self) -> Iterable[Any]:
        s = self.clf.stats
        for name, value, doc in (
            ("classify_requests", s.requests, "classify forwards run"),
            ("classify_inputs", s.inputs, "inputs scored"),
            ("classify_tokens", s.tokens, "tokens scored"),
            ("classify_seconds", s.seconds, "seconds in forward passes"),
        ):
            c = CounterMetricFamily(f"areal_hex_{name}", doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("areal_hex_classify_max_batch", "inputs per forward at most")
        g.add_metric([], self.clf.max_batch)
        yield g

"""Wiring of the built-in server: build the engine from config, run uvicorn.

build_engine(model_cfg, inference_cfg) -> Engine
build_server_app(model_cfg, inference_cfg) -> FastAPI
serve(model_cfg, inference_cfg, port)          # blocks
with ServerThread(app) as url: ...            # a server on a free loopback port
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from areal_hex.config import InferenceConfig, ModelConfig
from areal_hex.config.reward import RewardModelConfig
from areal_hex.heap import keep_heap
from areal_hex.net import WaitAborted, wait_until
from rollout_service.server.app import ServerSettings, create_app
from rollout_service.server.engine import Engine, EngineOptions

log = logging.getLogger(__name__)


def _load_tokenizer(path: str | None) -> Any | None:
    if path is None:
        return None
    from areal_hex.models import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as exc:  # a weights-only directory: serve input_ids only
        log.warning("no tokenizer at %s (%s): text prompts are disabled", path, exc)
        return None


def load_initial(model_cfg: ModelConfig, device: str) -> tuple[Any, Any | None, str]:
    """(model, tokenizer or None, model path shown by /get_model_info)."""
    from areal_hex import models

    if model_cfg.path is None:
        if model_cfg.tiny is None:
            raise ValueError("model: set model.path (HF name or directory) or model.tiny")
        tok = models.build_tokenizer()
        model = models.build_tiny_model(model_cfg.tiny, tok, seed=model_cfg.seed)
        model = model.to(device=device, dtype=models.torch_dtype(model_cfg.dtype)).eval()
        return model, tok, "tiny"
    model = models.load_model(model_cfg.path, device, model_cfg.dtype)
    tok = _load_tokenizer(model_cfg.tokenizer_path or model_cfg.path)
    return model, tok, model_cfg.path


def build_engine(model_cfg: ModelConfig, inf: InferenceConfig) -> Engine:
    import torch

    from areal_hex.models import load_model

    if inf.num_threads is not None:
        torch.set_num_threads(inf.num_threads)
    model, tok, path = load_initial(model_cfg, inf.device)

    def reload(weights: str) -> Any:
        return load_model(weights, inf.device, model_cfg.dtype)

    opts = EngineOptions(
        device=inf.device,
        max_running_requests=inf.max_running_requests,
        context_length=min(inf.context_length, _max_positions(model)),
        max_prefill_tokens=inf.max_prefill_tokens,
        min_admit=inf.min_admit,
        seed=inf.seed,
    )
    return Engine(model, tok, reload, path, inf.weight_version, opts)


def _max_positions(model: Any) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)


def server_settings(model_cfg: ModelConfig, inf: InferenceConfig) -> ServerSettings:
    args = inf.model_dump(mode="json", exclude={"api_key", "sglang"})
    args["model_path"] = model_cfg.path
    args["dtype"] = model_cfg.dtype
    return ServerSettings(
        api_key=inf.api_key,
        weights_dir=inf.weights_dir,
        tokenizer_path=model_cfg.tokenizer_path or model_cfg.path,
        server_args=args,
        max_prompt_chars=inf.max_prompt_chars,
    )


def build_server_app(model_cfg: ModelConfig, inf: InferenceConfig):  # -> FastAPI
    return create_app(build_engine(model_cfg, inf), server_settings(model_cfg, inf))


def build_reward_app(rm: RewardModelConfig, path: str, inf: InferenceConfig):  # -> FastAPI
    """The built-in server in reward-model mode: the sequence classifier at `path`
    behind SGLang's /classify (rollout_service/server/classify_routes.py)."""
    import torch

    from areal_hex.reward_model import load_reward_model
    from rollout_service.server.classifier import Classifier
    from rollout_service.server.classify_routes import create_reward_app

    if rm.num_threads is not None:
        torch.set_num_threads(rm.num_threads)
    model = load_reward_model(path, rm.device, rm.dtype)
    tokenizer_path = rm.tokenizer_path or path
    clf = Classifier(model, _load_tokenizer(tokenizer_path), path, max_batch=rm.max_batch)
    args = rm.model_dump(mode="json", include={"dtype", "device", "max_batch", "num_threads"})
    settings = ServerSettings(
        api_key=inf.api_key,
        tokenizer_path=tokenizer_path,
        server_args={**args, "model_path": path},
    )
    return create_reward_app(clf, settings)


def serve(model_cfg: ModelConfig, inf: InferenceConfig, port: int, app: Any = None) -> None:
    """Run the built-in server on `inf.host:port` until SIGINT/SIGTERM (`app`: one built
    already, e.g. by `build_reward_app`; else the generation server of `model_cfg`)."""
    import uvicorn

    logging.basicConfig(level=inf.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if app is None:
        if inf.device == "cpu":
            # the running batch's KV buffers, made anew at each merge, stay mapped
            # (a release of the server's memory trims the heap: step_loop.Core.memory)
            keep_heap()
        app = build_server_app(model_cfg, inf)
        if inf.weights_dir:
            Path(inf.weights_dir).mkdir(parents=True, exist_ok=True)
    # On SIGTERM, requests still running after 5 s are cancelled (their generations are
    # aborted) so the engine can stop.
    uvicorn.run(
        app,
        host=inf.host,
        port=port,
        log_level=inf.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


class ServerThread:
    """Run an app under uvicorn in a background thread on a free loopback port.

    `with ServerThread(app) as url:` yields `http://127.0.0.1:<port>`; leaving the block
    stops the server (the app's lifespan stops its engine). `port`: this one instead."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", start_timeout_s: float = 60.0, port: int = 0
    ) -> None:
        import uvicorn

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = ""

    def __enter__(self) -> str:
        self.thread.start()
        try:
            started = wait_until(
                lambda: self.server.started,
                self.start_timeout_s,
                interval_s=0.02,
                alive=self.thread.is_alive,
            )
        except WaitAborted:
            started = False
        if not started:
            raise RuntimeError("the server thread did not start")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.server.should_exit = True
        self.thread.join(30)

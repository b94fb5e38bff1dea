"""The inference server a profile times: `areal-hex serve` on the profiled devices (their
cores, or inside a box node), its config, and the wait until it serves."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from hexctl.job.processes import stop_process
from hexctl.profile.controller import ProfileFailed
from hexctl.profile.devices import LocalDevices
from rollout_service.client import GenerationError

SERVER_LOG_LINES = 15  # of the server's log, in the error when a profile cannot go on
SERVER_START_S = 180.0  # a profile's server loads its model and answers /health within this


@contextlib.contextmanager
def server_process(
    config: Path, dev: LocalDevices, log_path: Path, extra: list[str] | None = None
) -> Iterator[tuple[str, int]]:
    """`areal-hex serve CONFIG [extra]` on `dev` (its cores, or inside its box node),
    stopped at the end; (its URL, its pid)."""
    from areal_hex.net import free_port

    port = free_port()
    cores = dev.inference_cores
    env = dict(os.environ, OMP_NUM_THREADS=str(dev.inference_threads))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "hexctl.cli", "serve", str(config), *(extra or [])]
    cmd += ["--port", str(port)]
    cmd = dev.node_prefix + cmd
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
        url = f"http://{dev.address}:{port}"
        try:
            wait_serving(proc, url)
            yield url, proc.pid
        except (ProfileFailed, GenerationError) as exc:
            # the profile cannot go on without its server: what the server said last
            tail = log_path.read_text(errors="replace").splitlines()[-SERVER_LOG_LINES:]
            lines = "\n".join(f"  {line}" for line in tail)
            raise ProfileFailed(f"{exc}\nthe server's last log lines:\n{lines}") from exc
        finally:
            stop_process(proc)


def wait_serving(proc: subprocess.Popen, url: str, timeout_s: float = SERVER_START_S) -> None:
    """Until the server at `url` answers `/health`; a server that exits first (an import
    error, a bad config, a device it cannot use) fails the profile at once, not after
    `timeout_s` of waiting on a dead process."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise ProfileFailed(f"the inference server exited (code {code}) before it served")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise ProfileFailed(f"the inference server at {url} did not serve within {timeout_s:.0f} s")


def serve_config(cfg: ExperimentConfig, model_dir: Path, dev: LocalDevices) -> dict[str, Any]:
    """The `areal-hex serve` config of the server a profile times on `dev`."""
    return {
        "model": {"path": str(model_dir), "dtype": cfg.model.dtype},
        "inference": {
            "device": cfg.inference.device,
            "host": dev.address,
            "num_threads": dev.inference_threads,
            "max_running_requests": cfg.inference.max_running_requests,
            "context_length": cfg.inference.context_length,
            "weights_dir": str(model_dir.parent),
        },
        "data": {"max_prompt_tokens": cfg.data.max_prompt_tokens},
        "rollout": {"max_new_tokens": cfg.rollout.max_new_tokens},
    }

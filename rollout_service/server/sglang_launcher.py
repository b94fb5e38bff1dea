"""Start a real SGLang server (GPU hosts) from the inference config and wait until healthy.

SGLang is installed separately (`pip install "sglang[all]"`); this module only builds
its command line, runs it, echoes its output, and fails with the process's last log
lines when it exits or does not answer `/health` in time.
"""

from __future__ import annotations

import collections
import os
import shlex
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from types import FrameType
from typing import TextIO

from areal_hex.config import InferenceConfig, ModelConfig
from areal_hex.net import WaitAborted, wait_until


class SGLangLaunchError(RuntimeError):
    """The server exited or never became healthy; the message ends with its last lines."""


def launch_command(
    model_cfg: ModelConfig,
    inf: InferenceConfig,
    port: int,
    python: str | None = None,
    is_embedding: bool = False,
) -> list[str]:
    """`python -m sglang.launch_server ...` for server `port` of this config;
    `is_embedding`: a reward model (SGLang's `--is-embedding`, answering /classify)."""
    if model_cfg.path is None:
        raise ValueError(
            "inference.backend=sglang needs model.path (an HF name or directory); "
            "the tiny in-memory model runs on the builtin backend only"
        )
    s = inf.sglang
    cmd = [
        python or s.python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_cfg.path,
        "--host",
        inf.host,
        "--port",
        str(port),
        "--tp-size",
        str(s.tp_size),
        "--mem-fraction-static",
        str(s.mem_fraction_static),
        "--dtype",
        s.dtype,
        "--max-running-requests",
        str(inf.max_running_requests),
        "--random-seed",
        str(inf.seed),
        "--enable-metrics",
        "--weight-version",
        inf.weight_version,
    ]
    if model_cfg.tokenizer_path:
        cmd += ["--tokenizer-path", model_cfg.tokenizer_path]
    if inf.api_key:
        cmd += ["--api-key", inf.api_key]
    if is_embedding:
        cmd.append("--is-embedding")
    return cmd + list(s.extra_args)


def redacted(cmd: Sequence[str]) -> str:
    """The command as a shell line with the API key hidden (for logs)."""
    out = list(cmd)
    for i, arg in enumerate(out[:-1]):
        if arg == "--api-key":
            out[i + 1] = "***"
    return shlex.join(out)


class SGLangProcess:
    """A launched server: its output is echoed to `echo` and its tail kept for errors."""

    def __init__(self, cmd: Sequence[str], echo: TextIO | None = None, tail_lines: int = 40):
        self.cmd = list(cmd)
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._echo = echo
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> SGLangProcess:
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=dict(os.environ),
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self._echo is not None:
                self._echo.write(line)
                self._echo.flush()

    def last_lines(self) -> str:
        if self._reader is not None:
            self._reader.join(0.5)
        return "\n".join(self.tail) or "(no output)"

    def wait_healthy(self, url: str, timeout_s: float, interval_s: float = 1.0) -> None:
        """Poll `url` (…/health) until it answers 200; raise SGLangLaunchError when the
        process exits first or `timeout_s` passes."""
        assert self.proc is not None, "start() first"
        proc = self.proc
        try:
            if wait_until(
                lambda: _http_ok(url),
                timeout_s,
                interval_s=interval_s,
                alive=lambda: proc.poll() is None,
            ):
                return
        except WaitAborted:
            raise SGLangLaunchError(
                f"SGLang server exited with code {proc.poll()} before {url} was healthy; "
                f"command: {redacted(self.cmd)}\nlast output:\n{self.last_lines()}"
            ) from None
        self.stop()
        raise SGLangLaunchError(
            f"SGLang server not healthy at {url} after {timeout_s:.0f} s (stopped it); "
            f"command: {redacted(self.cmd)}\nlast output:\n{self.last_lines()}"
        )

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as resp:  # noqa: S310 (local URL)
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def run_sglang(
    model_cfg: ModelConfig, inf: InferenceConfig, port: int, is_embedding: bool = False
) -> int:
    """Launch, wait for health, then stay in the foreground until the server exits
    (SIGTERM/SIGINT are passed on). Returns its exit code."""
    cmd = launch_command(model_cfg, inf, port, is_embedding=is_embedding)
    print(f"starting: {redacted(cmd)}", flush=True)
    server = SGLangProcess(cmd, echo=sys.stdout).start()

    def forward(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    host = "127.0.0.1" if inf.host in ("0.0.0.0", "::", "") else inf.host
    server.wait_healthy(f"http://{host}:{port}/health", inf.startup_timeout_s)
    print(f"SGLang server healthy on port {port}", flush=True)
    return server.wait()

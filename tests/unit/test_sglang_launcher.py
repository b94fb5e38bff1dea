"""The SGLang launcher: command line from config, health wait, clear failures.

SGLang itself cannot run here; the process tests start small Python stand-ins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_hex.config import InferenceConfig, ModelConfig, SGLangConfig, TinyModelConfig
from areal_hex.net import free_port
from rollout_service.server.sglang_launcher import (
    SGLangLaunchError,
    SGLangProcess,
    launch_command,
    redacted,
)

ROOT = Path(__file__).resolve().parents[2]


def arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_command_from_config() -> None:
    inf = InferenceConfig(
        backend="sglang",
        host="0.0.0.0",
        weight_version="3",
        max_running_requests=32,
        seed=7,
        sglang=SGLangConfig(
            tp_size=2,
            mem_fraction_static=0.7,
            dtype="float16",
            extra_args=["--disable-radix-cache", "--skip-server-warmup"],
        ),
    )
    model = ModelConfig(path="/w/v3", tokenizer_path="/tok")
    cmd = launch_command(model, inf, port=30005, python="/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert arg(cmd, "--model-path") == "/w/v3" and arg(cmd, "--tokenizer-path") == "/tok"
    assert arg(cmd, "--host") == "0.0.0.0" and arg(cmd, "--port") == "30005"
    assert arg(cmd, "--tp-size") == "2" and arg(cmd, "--mem-fraction-static") == "0.7"
    assert arg(cmd, "--dtype") == "float16" and arg(cmd, "--weight-version") == "3"
    assert arg(cmd, "--max-running-requests") == "32" and arg(cmd, "--random-seed") == "7"
    assert "--enable-metrics" in cmd and "--api-key" not in cmd
    assert cmd[-2:] == ["--disable-radix-cache", "--skip-server-warmup"]


def test_api_key_is_passed_and_redacted() -> None:
    inf = InferenceConfig(backend="sglang", api_key="tok-123")
    cmd = launch_command(ModelConfig(path="Qwen/Qwen3-0.6B"), inf, port=1234)
    assert arg(cmd, "--api-key") == "tok-123" and cmd[0] == sys.executable
    shown = redacted(cmd)
    assert "tok-123" not in shown and "--api-key '***'" in shown


def test_tiny_model_is_refused() -> None:
    with pytest.raises(ValueError, match="needs model.path"):
        launch_command(ModelConfig(tiny=TinyModelConfig()), InferenceConfig(), port=1)


def test_cli_prints_the_command() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "hexctl.cli", "serve"]
    out = subprocess.run(
        [*base, "model.path=/m", "inference.backend=sglang", "inference.api_key=k9",
         "--index", "0", "--port", "31111", "--print-command"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "sglang.launch_server --model-path /m" in out.stdout and "--port 31111" in out.stdout
    assert "k9" not in out.stdout
    bad = subprocess.run(
        [*base, "model.tiny={}", "inference.backend=sglang", "--print-command"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "needs model.path" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.timeout(60)
def test_exit_before_healthy_reports_last_lines() -> None:
    script = (
        "import sys\nfor i in range(100): print('line', i)\n"
        "print('CUDA out of memory')\nsys.exit(3)"
    )
    proc = SGLangProcess([sys.executable, "-c", script]).start()
    with pytest.raises(SGLangLaunchError) as err:
        proc.wait_healthy("http://127.0.0.1:9/health", timeout_s=30, interval_s=0.1)
    msg = str(err.value)
    assert "exited with code 3" in msg and "CUDA out of memory" in msg and "line 99" in msg
    assert "line 5\n" not in msg  # only the tail


@pytest.mark.timeout(60)
def test_waits_for_health_then_times_out_or_succeeds() -> None:
    # a stand-in server that answers /health only after a delay
    port = free_port()
    script = textwrap.dedent(f"""
        import http.server, time
        print('loading weights', flush=True)
        time.sleep(1.0)
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == '/health' else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()
    """)
    proc = SGLangProcess([sys.executable, "-c", script]).start()
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=30, interval_s=0.1)
        assert proc.proc is not None and proc.proc.poll() is None
    finally:
        proc.stop()
    assert proc.proc.poll() is not None

    hang = SGLangProcess(
        [sys.executable, "-c", "print('stuck', flush=True)\nimport time\ntime.sleep(60)"]
    )
    hang.start()
    with pytest.raises(SGLangLaunchError) as err:
        hang.wait_healthy(f"http://127.0.0.1:{free_port()}/health", timeout_s=1.0, interval_s=0.1)
    assert "not healthy" in str(err.value) and "stuck" in str(err.value)
    assert hang.proc is not None and hang.proc.poll() is not None  # stopped on timeout

"""A profile's inference server that dies before it serves fails the profile at once,
with its log, instead of a wait on a dead process."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time

import pytest

from hexctl.profile.controller import ProfileFailed
from hexctl.profile.server import wait_serving


def test_a_server_that_exits_fails_at_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    t0 = time.monotonic()
    with pytest.raises(ProfileFailed, match=r"exited \(code 3\) before it served"):
        wait_serving(proc, "http://127.0.0.1:9", timeout_s=60.0)
    assert time.monotonic() - t0 < 10.0


def test_a_server_that_never_answers_times_out() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(ProfileFailed, match="did not serve within 1 s"):
            wait_serving(proc, "http://127.0.0.1:9", timeout_s=1.0)
    finally:
        proc.kill()
        proc.wait()


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_serving_server_returns() -> None:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        wait_serving(proc, f"http://127.0.0.1:{httpd.server_port}", timeout_s=10.0)
    finally:
        httpd.shutdown()
        proc.kill()
        proc.wait()

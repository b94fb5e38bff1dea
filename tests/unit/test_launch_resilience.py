"""The launcher's side of resilience: a hung (SIGSTOPped) server is named on the progress
line and replaced like a dead one; every attempt counts, a killed one included."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from areal_hex.run_files import RunPaths
from hexctl.launch.attempts import AttemptLog, begin_attempt
from hexctl.launch.hung import HungServers
from hexctl.launch.progress import format_line
from hexctl.launch.supervisor import ProcessSpec, Supervisor
from hexctl.report.ledger import summary_fields

# A server with a /health that answers 200 (a stand-in for an inference server's).
HEALTH = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_sigstopped_server_is_named_then_replaced(tmp_path: Path) -> None:
    port = _free_port()
    cmd = [sys.executable, "-c", HEALTH, str(port)]
    spec = ProcessSpec("inference-0", cmd, tmp_path / "s.log", on_exit="restart")
    with Supervisor(poll_s=0.05) as sup:
        sup.start(spec)
        hung = HungServers(sup, {"inference-0": f"http://127.0.0.1:{port}"}, limit_s=3.0)
        try:
            first = sup.pid("inference-0")
            deadline = time.monotonic() + 20
            while ("inference-0", first) not in hung.last_ok:  # answered once
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.05)
            os.killpg(first, signal.SIGSTOP)
            named: dict[str, float] = {}
            while sup.pid("inference-0") == first:
                assert time.monotonic() < deadline, "the hung server was not replaced"
                named = hung.check() or named
                assert sup.check() is None
                time.sleep(0.05)
        finally:
            hung.close()
        assert "inference-0" in named  # shown as stalled before it was replaced
        line = format_line({"step": 3}, 10, 5.0, named)
        assert line.startswith("STALLED inference-0 (no answer ")
        events = [e for _, n, e in sup.events if n == "inference-0"]
        assert any(e.startswith("killed: no answer to /health") for e in events)
        assert events[-1] == "restart" and sup.procs["inference-0"].restarts == 1
        assert sup.running("inference-0")


def test_every_attempt_counts_a_killed_one_too(tmp_path: Path) -> None:
    with Supervisor() as sup:
        sup.events.append((time.time(), "trainer", "start"))
        killed = AttemptLog(tmp_path, sup, time.time(), begin_attempt(tmp_path))
        killed.tick()  # then its launcher is SIGKILLed: no end is written
    with Supervisor() as sup:
        clean = AttemptLog(tmp_path, sup, time.time(), begin_attempt(tmp_path))
        clean.end()
    assert (killed.n, clean.n) == (1, 2)
    events = json.loads(RunPaths.at(tmp_path).events.read_text())
    assert [a["ended"] for a in events["attempts"]] == [False, True]
    assert events["attempts"][0]["events"][0]["process"] == "trainer"
    assert summary_fields({}, events, [], 8)["attempts"] == 2

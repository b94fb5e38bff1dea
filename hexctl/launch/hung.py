"""Inference servers that stopped answering without dying (`run.hung_after_s`)."""

from __future__ import annotations

import threading
import time

from areal_hex.net import http_ok
from hexctl.launch.supervisor import Supervisor


class HungServers:
    """Inference servers that stopped answering without dying (e.g. SIGSTOPped): a thread
    probes each one's /health every `every_s` (with a timeout); one that answered since
    its start and then stays silent for `run.hung_after_s` is killed, and the supervisor
    starts it again as it would a dead one."""

    def __init__(self, sup: Supervisor, urls: dict[str, str], limit_s: float) -> None:
        """`urls`: {process name: base URL} of the servers; `limit_s`: run.hung_after_s."""
        self.urls = urls
        self.sup = sup
        self.limit_s = limit_s
        self.every_s = min(2.0, self.limit_s / 3)
        self.last_ok: dict[tuple[str, int], float] = {}  # (name, pid) -> last answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, daemon=True)
        if self.urls:
            self._thread.start()

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.every_s):
            for name, url in self.urls.items():
                pid = self.sup.pid(name)
                ok = http_ok(url, timeout_s=self.every_s)
                if ok and pid is not None:
                    self.last_ok[(name, pid)] = time.monotonic()

    def check(self) -> dict[str, float]:
        """{server: seconds without an answer} of the running servers silent for longer
        than two probes; kills those silent for `hung_after_s`."""
        stalled = {}
        now = time.monotonic()
        for name in self.urls:
            pid = self.sup.pid(name)
            last = self.last_ok.get((name, pid)) if pid is not None else None
            if last is None or not self.sup.running(name):
                continue  # starting (or dead: the supervisor's business)
            silent = now - last
            if silent > 2 * self.every_s + 1.0:
                stalled[name] = silent
            if silent > self.limit_s:
                self.sup.kill(name, f"no answer to /health for {silent:.0f} s (hung)")
        return stalled

    def close(self) -> None:
        self._stop.set()

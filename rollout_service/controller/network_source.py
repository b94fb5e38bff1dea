"""Where the controller learns about versions sent over the network
(rollout.weight_sync=network): their manifests, and the members of each weight-update
group, agreed with the trainer through the run's Redis (the protocol is in
weight_sync.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from areal_hex.weight_net import Manifest


class NetworkSource:
    """Where versions sent over the network are described: their manifests (left by the
    trainer in the buffer's Redis), read with `read(version)`, which returns None until
    the manifest is there; `manifest` waits for it up to `timeout_s`. A group's members
    are agreed with the trainer through `record(group_name, urls)`, which records them
    unless the group has members recorded already and returns the ones recorded (the
    trainer sizes the group from them); `ask_regroup(group_name)` asks the trainer for
    a new group in place of that one (a server that is up is not in it)."""

    def __init__(
        self,
        read: Callable[[int], Awaitable[Manifest | None]],
        ranks_per_server: int = 1,
        timeout_s: float = 300.0,
        poll_s: float = 0.2,
        record: Callable[[str, list[str]], Awaitable[list[str]]] | None = None,
        ask_regroup: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.read = read
        self.ranks_per_server = ranks_per_server
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.record = record or _as_given
        self.ask_regroup = ask_regroup or _nobody_to_ask

    async def manifest(
        self, version: int, superseded: Callable[[], bool] = lambda: False
    ) -> Manifest | None:
        """N's manifest, waiting for it up to `timeout_s`, or None once `superseded()`
        (a newer version was announced: a trainer that died before leaving N's manifest,
        or whose manifests the launcher cleared, never will)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            m = await self.read(version)
            if m is not None or time.monotonic() >= deadline or superseded():
                return m
            await asyncio.sleep(self.poll_s)


async def _as_given(group_name: str, urls: list[str]) -> list[str]:
    return urls


async def _nobody_to_ask(group_name: str) -> None:
    return None

"""The weight-update protocol, controller side: from a published version to servers that
generate with it.

The sequence, across processes:

1. publish (trainer, rank 0; trainer_service/publish.py), by `rollout.weight_sync`:
   disk: write `weights/v<N>` (write, then rename), SET `<run>:version` = N and the
   path, PUBLISH {version, path} (areal_hex/buffer/consumer.py
   `RedisWeightPublisher.set_version`).
   network: plan the buckets, SET the manifest `<run>:weights_manifest:<N>` (the group's
   address and name, each bucket's names, dtypes, shapes: areal_hex/weight_net.py),
   SET + PUBLISH N with no path; then join the weight-update group as its rank 0 and
   broadcast bucket after bucket. A new group's size comes from its members, which
   the controller records in step 4 (`<run>:weights_members:<group>`, set once: the
   trainer waits `rollout.weight_sync_join_timeout_s` for them, then claims the group
   empty and forms none); it forms once those have joined.
2. notify (buffer -> controller): `TrajectoryProducer.watch_versions()` yields N;
   `WeightSync.follow` coalesces versions that arrive during a reload (only the newest
   is loaded next).
3. pause: `UpdateGate.close()` stops new requests in this controller; every healthy
   server gets `/pause_generation` — `abort` (SGLang's way: running requests end with
   their partial output and are resent by the sampler, from the tokens they have) or
   `retract` (ours: requests stay, their KV cache is recomputed with the new weights) or
   `in_place` (requests and their KV cache stay; PipelineRL's in-flight update);
   `resolve_pause_mode` picks one (an `api.PauseMode`) from `rollout.update_pause` and
   what the servers report.
4. load: disk: `/update_weights_from_disk` with `weight_version` = N on each paused
   server (server side: rollout_service/server/app.py `_weight_routes` ->
   engine.Engine.update_weights -> step_loop.Core reloads between two decode steps and,
   under retract, recomputes).
   network: read N's manifest; a group new to the controller gets as members the
   servers healthy now (recorded for the trainer, unless already recorded: then the
   record stands), which join it all at once (`/init_weights_update_group`, member i
   as rank 1 + i of 1 + members); a healthy server outside the group has the
   controller ask the trainer for a new one (`<run>:weights_regroup`), which the
   next version (or this one, sent again at once) forms; then for each bucket in order,
   every server at once `/update_weights_from_distributed` {names, dtypes, shapes,
   group_name} — the server receives the trainer's broadcasts into new tensors
   (engine.Engine.update_weights_from_group) and copies them into the model between two
   steps, as a reload; the last bucket carries `weight_version` = N. The trainer's
   broadcast of a bucket completes when every server has received it.
5. resume: `/continue_generation`; the gate reopens at version N and the controller tells
   the staleness gate that the servers serve N (`set_serving_version`): the buffer admits
   groups for N only from then on, not from the publish.
6. per-token versions: every output token carries the version that sampled it (ours in
   `meta_info.output_token_versions`; SGLang's one `weight_version` per response), so a
   sample that spans an update has mixed versions and the group's version is its oldest.
7. recover: a server that failed during any step is marked unhealthy and left out; when
   the dispatcher's probe finds it healthy again, `WeightSync.recover` reloads the
   current weights on it (disk; unless it already reports them; weights damaged on
   disk since: the newest complete version there instead) and resumes it. A version
   that no server could load is not the current one for recovery. Over
   the network a server that failed is out of its group: it resumes with the weights it
   has (its tokens carry their version) until the trainer, whose broadcast failed with
   it (or which the controller asks, as for a server that was not up when the group
   formed), forms the next group (a new `group_name` in the next manifest) and every
   server up then joins that one. No join waits for a missing member longer than
   `rollout.weight_sync_join_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from areal_hex.api import GenerationClient, PauseMode, TrajectoryProducer
from areal_hex.config.rollout import UpdatePause
from areal_hex.run_files import version_dir, versions_in
from areal_hex.weight_net import GroupSpec
from rollout_service.controller.dispatch import SERVER_ERRORS, Dispatcher, ServerState
from rollout_service.controller.network_source import NetworkSource

log = logging.getLogger(__name__)


class UpdateGate:
    """Whether new requests may start (closed during a weight update) and which update
    epoch is current, so an abort caused by our own update is told from a stray one."""

    def __init__(self, version: int = 0) -> None:
        self.version = version  # last policy version applied to the servers
        self.epoch = 0  # incremented when an update starts
        self._open = asyncio.Event()
        self._open.set()

    def close(self) -> None:
        self.epoch += 1
        self._open.clear()

    def reopen(self, version: int | None = None) -> None:
        if version is not None:
            self.version = version
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()


# ---------------------------------------------------------------- pause mode
async def reports_token_versions(client: GenerationClient) -> bool:
    """Whether the server behind `client` tags each output token with its version."""
    try:
        return bool((await client.server_info()).get("output_token_versions"))
    except SERVER_ERRORS:  # unreachable now: treat it as one that does not
        return False


async def resolve_pause_mode(mode: UpdatePause, clients: Sequence[GenerationClient]) -> PauseMode:
    """The mode to use for `rollout.update_pause=mode` with these servers:
    abort stays abort; retract and in_place need every server to report per-token
    versions (else their tokens are tagged per response, with a warning); auto =
    retract when all do."""
    if mode == "abort":
        return mode
    ok = await asyncio.gather(*[reports_token_versions(c) for c in clients])
    if mode in ("retract", "in_place"):
        if not all(ok):
            log.warning(
                "rollout.update_pause=%s, but %d server(s) do not report per-token "
                "versions: their tokens are tagged with the version of each response",
                mode,
                ok.count(False),
            )
        log.info("weight updates: %s in-flight requests", mode)
        return mode
    chosen: PauseMode = "retract" if all(ok) else "abort"
    log.info("weight updates: %s in-flight requests", chosen)
    return chosen


# ---------------------------------------------------------------- the protocol
FINISH_ON_CANCEL_S = 30.0  # an update under way when its task is cancelled: time to end


class WeightSync:
    """Keeps the servers of one controller on the newest published weights."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        producer: TrajectoryProducer,
        gate: UpdateGate,
        weights_dir: str | None = None,
        network: NetworkSource | None = None,
    ) -> None:
        """`network`: versions arrive over the network (rollout.weight_sync=network)."""
        self.dispatcher = dispatcher
        self.producer = producer
        self.gate = gate
        self.weights_dir = weights_dir
        self.network = network
        self.joined: dict[str, str] = {}  # server URL -> weight group it is a member of
        self.pause_mode: PauseMode = "abort"
        self.applied: tuple[int, str] | None = None  # last (version, path) loaded
        self.serving = 0  # the version every healthy server holds, as told to the gate
        self._catching_up: set[asyncio.Task[None]] = set()
        self._caught_up: set[tuple[int, str, str]] = set()  # (version, group, server)
        self._newer: Callable[[], bool] = lambda: False  # a newer version is pending
        self.received: tuple[int, str] | None = None  # (version, group) last broadcast
        self.lineage = 0  # of the version the gate holds (VersionUpdate.lineage)
        self.syncs_total = 0
        self.sync_s_total = 0.0
        # awaited after the gate closed, before the servers pause and load (colocated:
        # they take their memory back, colocate.py)
        self.before_update: list[Callable[[], Awaitable[None]]] = []
        # awaited once the servers continued on the new version (hybrid: lend.py)
        self.after_update: list[Callable[[], Awaitable[None]]] = []
        # whether an update of (version, path) leaves a server out (hybrid: a lent
        # server paused for the trainer loads when it continues, lend.py)
        self.leave_out: Callable[[ServerState, tuple[int, str]], bool] = lambda _s, _w: False
        self._lock = asyncio.Lock()

    async def start(self, update_pause: UpdatePause) -> None:
        """Choose the pause mode and report the version served now to the gate."""
        self.pause_mode = await resolve_pause_mode(
            update_pause, [s.client for s in self.dispatcher.servers]
        )
        self._serve(self.gate.version)

    def _serve(self, version: int) -> None:
        """Tell the gate the servers' version: groups are admitted against the older of
        it and the published one, so servers behind hold the gate instead of making
        groups the trainer would drop as stale."""
        self.serving = version
        self.producer.set_serving_version(version)

    async def follow(self) -> None:
        """(2) Follow version notifications; reload to the newest one. Versions published
        while a reload runs are coalesced: only the latest is loaded next."""
        latest: list[tuple[int, int, str]] = []  # at most one pending (lineage, version, path)
        wake = asyncio.Event()
        self._newer = lambda: bool(latest)

        async def apply() -> None:
            # A server that fails a step is handled inside `update` (unhealthy, reloaded
            # on recovery); anything else raised here is a bug and ends `follow`.
            while True:
                await wake.wait()
                wake.clear()
                lineage, version, path = latest.pop()
                if (lineage, version) > (self.lineage, self.gate.version):
                    self.lineage = lineage  # a restore may go back to a lower version
                    await self.update(version, path)

        async def watch() -> None:
            async for upd in self.producer.watch_versions():
                newest = latest[0][:2] if latest else (self.lineage, self.gate.version)
                if (upd.lineage, upd.version) > newest:
                    latest[:] = [(upd.lineage, upd.version, upd.path)]
                    wake.set()

        tasks = {asyncio.create_task(apply()), asyncio.create_task(watch())}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # re-raises the applier's or the watcher's error
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) until no update is under way; True if none is."""

        async def idle() -> None:
            async with self._lock:
                pass

        try:
            await asyncio.wait_for(idle(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def update(self, version: int, path: str) -> None:
        """(3)-(5) Pause every healthy server, load `path` (or, over the network, the
        trainer's broadcast) as `version`, resume."""
        if not path and self.weights_dir and self.network is None:
            path = str(version_dir(self.weights_dir, version))
        if not path and self.network is None:
            log.warning("version %d has no weights path; not reloading", version)
            self._serve(version)
            for hook in self.after_update:
                await hook()
            return
        async with self._lock:
            # Cancelled between the pause and the resume, the servers would stay paused
            # and every later request would wait on them: the update is given up to
            # FINISH_ON_CANCEL_S to end (a server that hangs does not hold a stop for
            # long), then the cancellation goes on.
            work = asyncio.ensure_future(self._pause_load_resume(version, path))
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                _, late = await asyncio.wait({work}, timeout=FINISH_ON_CANCEL_S)
                for t in late:
                    t.cancel()
                raise

    async def _pause_load_resume(self, version: int, path: str) -> None:
        """`update`'s steps (3)-(5), under its lock."""
        t0 = time.monotonic()
        self.gate.close()
        try:
            for hook in self.before_update:
                await hook()
            at = (version, path)
            servers = [s for s in self.dispatcher.servers if s.healthy]
            servers = [s for s in servers if not self.leave_out(s, at)]
            tried = len(servers)
            # retract / in_place: the servers keep the requests in flight (their KV
            # cache recomputed / kept); abort (SGLang's default call): they end and
            # the sampler resends them.
            keep = self.pause_mode in ("retract", "in_place")
            mode = self.pause_mode
            servers = await self._phase(servers, "pause", lambda s: s.client.pause(mode))
            if self.network is not None:
                servers = await self._receive(servers, version, abort_all=not keep)
            else:
                servers = await self._phase(
                    servers,
                    "update",
                    lambda s: s.client.update_weights_from_disk(
                        path, version, abort_all_requests=not keep
                    ),
                )
            await self._phase(servers, "continue", lambda s: s.client.resume())
            # no server healthy: from disk, recovery loads it on each; over the network
            # nobody has it. Every server failing it: nobody has it, and recovery does
            # not retry it.
            loaded = bool(servers) or (not tried and self.network is None)
            if loaded:
                self.applied = (version, path)
        finally:
            self.gate.reopen(version)
        # not loaded anywhere (over the network: every broadcast failed): the servers keep
        # the version they had, and so does the gate, until it is sent again
        self._serve(version if loaded else self.serving)
        for hook in self.after_update:
            await hook()
        dt = time.monotonic() - t0
        self.syncs_total += 1
        self.sync_s_total += dt
        log.info("weights v%d loaded on %d server(s) in %.2f s", version, len(servers), dt)

    async def _receive(
        self, servers: list[ServerState], version: int, abort_all: bool
    ) -> list[ServerState]:
        """(4, network) Join N's group where needed, then every bucket on every server."""
        assert self.network is not None
        manifest = await self.network.manifest(version, self._newer)
        if manifest is None:
            log.warning("version %d: no weights manifest arrived; not loading it", version)
            return servers
        group = manifest.group
        if self.received == (version, group.group_name):
            # announced again (a restore) with nothing new sent: waiting for a broadcast
            # that will not come would hold the servers until the timeout
            return servers
        members = [s for s in servers if self.joined.get(s.client.base_url) == group.group_name]
        if group.group_name not in self.joined.values():
            members = await self._join_new(servers, group)
        if len(members) < len(servers):
            log.warning(
                "%d server(s) are not in weight group %s: they keep their weights until "
                "the next group, asked for now",
                len(servers) - len(members),
                group.group_name,
            )
            await self.network.ask_regroup(group.group_name)
        last = len(manifest.buckets) - 1
        for i, bucket in enumerate(manifest.buckets):
            tag = version if i == last else None
            members = await self._phase(
                members,
                f"bucket {i + 1}/{last + 1}",
                lambda s, b=bucket, v=tag: s.client.update_weights_from_distributed(
                    b, group.group_name, v, abort_all_requests=abort_all
                ),
            )
        if members:
            self.received = (version, group.group_name)
        # every server that did not fail goes on, in the group or not
        return [s for s in servers if s.healthy]

    async def _join_new(self, servers: list[ServerState], group: GroupSpec) -> list[ServerState]:
        """A new group: its members are the servers up now (`servers`), unless the group
        already has members recorded (the trainer, tired of waiting, found none; or an
        earlier update recorded them); they join together, each at its rank among the
        members, in a group sized to them."""
        assert self.network is not None
        rpp = self.network.ranks_per_server
        urls = await self.network.record(group.group_name, [s.client.base_url for s in servers])
        sized = replace(group, world_size=1 + len(urls) * rpp)
        chosen = [s for s in servers if s.client.base_url in urls]
        return await self._phase(
            chosen,
            "join",
            lambda s: self._join(s, sized, 1 + urls.index(s.client.base_url) * rpp),
        )

    async def _join(self, server: ServerState, group: GroupSpec, rank: int) -> None:
        url = server.client.base_url
        old = self.joined.pop(url, None)
        if old is not None:  # leave the broken group first (best effort: it may be gone)
            try:
                await server.client.destroy_weights_update_group(old)
            except SERVER_ERRORS as exc:
                log.info("%s: leaving weight group %s: %s", url, old, exc)
        await server.client.init_weights_update_group(group, rank)
        self.joined[url] = group.group_name

    async def _phase(
        self,
        servers: list[ServerState],
        name: str,
        call: Callable[[ServerState], Awaitable[Any]],
    ) -> list[ServerState]:
        """One step of the update on each server; a server that fails it is marked
        unhealthy (it reloads on recovery) and left out of the next steps."""

        async def one(s: ServerState) -> bool:
            try:
                await call(s)
                return True
            except SERVER_ERRORS as exc:
                self.dispatcher.mark_unhealthy(s, f"weight update ({name}) failed: {exc}")
                return False

        ok = await asyncio.gather(*[one(s) for s in servers])
        return [s for s, good in zip(servers, ok, strict=True) if good]

    async def recover(self, server: ServerState) -> None:
        """(7) A server back from the dead may hold old weights (or still be paused)."""
        async with self._lock:
            if self.network is not None:
                # out of its group (see (7)): it joins the next one the trainer forms
                left = self.joined.pop(server.client.base_url, None)
                held = await server.client.weight_version()
                if held is not None and held < self.serving:
                    log.warning(
                        "%s restarted with weights v%d, not v%d: the gate holds until the "
                        "trainer sends a version again",
                        server.client.base_url,
                        held,
                        self.serving,
                    )
                    self._serve(held)
                if held is not None and held < self.gate.version:
                    await self._ask_regroup()
                    await self._catch_up(server.client.base_url, left)
            elif self.applied is not None:
                version, path = self.applied
                # Skip the reload when a transient error did not cost the server its weights.
                if await server.client.weight_version() != version:
                    await self._reload(server, version, path)
            await server.client.resume()

    async def _ask_regroup(self) -> None:
        """Ask the trainer for a new group in place of the current version's (a server
        that came back is not in it); the trainer sends the version again over it."""
        assert self.network is not None
        manifest = await self.network.read(self.gate.version)
        if manifest is not None:
            await self.network.ask_regroup(manifest.group.group_name)

    async def _catch_up(self, server_url: str, left: str | None) -> None:
        """A version announced (or sent again) while a server was down waits, in a group
        of its own, for every server to join: once the recovered server is healthy, the
        current version is loaded again (the server joins that group). Not when the
        current version's group is the one the server just left (the trainer then sends
        the next version, or this one again, over a new group)."""
        assert self.network is not None
        version = self.gate.version
        manifest = await self.network.read(version)
        if manifest is None or manifest.group.group_name == left:
            return
        tried = (version, manifest.group.group_name, server_url)
        if tried in self._caught_up:
            return  # once per server and group: a join that fails again is not a loop
        self._caught_up.add(tried)
        task = asyncio.get_running_loop().create_task(self.update(version, ""))
        self._catching_up.add(task)
        task.add_done_callback(self._catching_up.discard)

    async def _reload(self, server: ServerState, version: int, path: str) -> None:
        """Load `path` on a recovered server; weights damaged or removed on disk since
        they were published (no config.json there: a crash during their removal, or a
        storage fault) are named, and the newest complete version on disk is loaded
        instead, until the trainer publishes the next one — never the same failure in a
        loop."""
        try:
            await server.client.update_weights_from_disk(path, version)
            return
        except SERVER_ERRORS:
            fallback = self._newest_complete(below=version)
            if fallback is None or (Path(path) / "config.json").is_file():
                raise
        older, older_path = fallback
        log.error(
            "weights v%d at %s are incomplete on disk (no config.json); %s loads v%d, the "
            "newest complete version there, until the next version is published",
            version,
            path,
            server.client.base_url,
            older,
        )
        await server.client.update_weights_from_disk(older_path, older)
        self.applied = (older, older_path)

    def _newest_complete(self, below: int) -> tuple[int, str] | None:
        """(version, path) of the newest complete version under `weights_dir` older than
        `below`, if the controller sees that directory."""
        if not self.weights_dir or not Path(self.weights_dir).is_dir():
            return None
        found = [v for v in versions_in(self.weights_dir, complete_only=True) if v < below]
        return (found[-1], str(version_dir(self.weights_dir, found[-1]))) if found else None

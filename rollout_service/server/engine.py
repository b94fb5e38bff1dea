"""The built-in inference engine: HF transformers with continuous batching.

One step-loop thread owns the model and the running batch. Between two decode steps it
applies control commands (abort, weight reload, in-place pause), prefills newly arrived
requests and merges them into the running batch; finished rows leave at once. The
asyncio side (`generate`, `pause`, ...) talks to it through a condition-guarded queue
and is woken through `loop.call_soon_threadsafe`.

Pausing follows SGLang: while paused, new requests wait before they reach the engine
(so an `abort_all_requests` weight update does not hit them); mode `abort` ends the
in-flight ones with their partial output, `in_place`/`retract` keep them and stop
stepping until `continue`. A reload while paused keeps the held requests: `in_place`
keeps their KV cache, `retract` recomputes it with the new weights (as if they had been
aborted and resent, without the round trip). Every output token carries the weight
version that sampled it (`meta_info.output_token_versions`, beyond SGLang's API).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_hex.api import PauseMode
from areal_hex.weight_net import GroupSpec, WeightGroup, parse_dtype
from rollout_service.server.grammar import Grammars
from rollout_service.server.requests import (
    NO_EXTRA_LOGPROBS,
    Control,
    EngineError,
    EngineOptions,
    GenRequest,
    LogprobSpec,
    check_request,
)
from rollout_service.server.step_loop import Core
from rollout_service.server.wakeups import LoopPost
from rollout_service.wire import FinishReason, SamplingParamsIn

log = logging.getLogger(__name__)
ModelLoader = Callable[[str], Any]  # weights directory -> model in eval mode on the device


@dataclass
class EngineStats:
    running: int
    waiting: int
    paused: bool
    weight_version: str
    gen_throughput: float  # generated tokens/s over the last window
    generation_tokens_total: int
    prompt_tokens_total: int
    requests_total: int
    aborted_total: int
    weight_updates_total: int
    prefill_batches_total: int
    decode_steps_total: int
    last_error: str | None


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any | None,
        load_model: ModelLoader,
        model_path: str,
        weight_version: str,
        options: EngineOptions,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.weight_version = weight_version
        self.opts = options
        self.load_model = load_model
        self.grammars = Grammars(tokenizer, int(model.config.vocab_size))
        self._cv = threading.Condition()
        self._waiting: deque[GenRequest] = deque()
        self._controls: deque[Control] = deque()
        self._inflight: dict[str, GenRequest] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate: asyncio.Event | None = None  # set = not paused
        self._post: LoopPost | None = None  # results onto the event loop
        self._core: Any = None  # the scheduler's state (rollout_service.server.step_loop.Core)
        self.counters = dict.fromkeys(
            ("gen", "prompt", "requests", "aborted", "updates", "prefills", "steps"), 0
        )
        self.last_error: str | None = None
        self.released: frozenset[str] = frozenset()  # /release_memory_occupation tags
        self._rate: deque[tuple[float, int]] = deque()
        self._n_running = 0
        self.weight_groups: dict[str, WeightGroup] = {}  # joined weight-update groups
        self._group_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the step-loop thread; call from the event loop that serves requests."""

        self._loop = asyncio.get_running_loop()
        self._post = LoopPost(self._loop)
        self._gate = asyncio.Event()
        self._gate.set()
        self._core = Core(self)
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._post.owner = self._thread
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def paused(self) -> bool:
        return self._gate is not None and not self._gate.is_set()

    # ------------------------------------------------------------------ requests
    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def validate(
        self, prompt: list[int], sampling: SamplingParamsIn, want: LogprobSpec = NO_EXTRA_LOGPROBS
    ) -> None:
        check_request(prompt, sampling, want, self.vocab_size, self.opts.context_length)

    async def generate(
        self,
        prompt: list[int],
        sampling: SamplingParamsIn,
        rid: str,
        on_token: Callable[[int], None] | None = None,
        want: LogprobSpec = NO_EXTRA_LOGPROBS,
    ) -> GenRequest:
        """Run one request to its end (stop, length or abort); raises EngineError.
        `on_token(n)` is called on the event loop each time the output reaches n tokens."""
        req, fut = self.open(prompt, sampling, rid, on_token, want)
        return await self.run(req, fut)

    def open(
        self,
        prompt: list[int],
        sampling: SamplingParamsIn,
        rid: str,
        on_token: Callable[[int], None] | None = None,
        want: LogprobSpec = NO_EXTRA_LOGPROBS,
        checked: bool = False,
    ) -> tuple[GenRequest, asyncio.Future[GenRequest]]:
        """Validate (unless `checked`: the caller did) and register a request
        (EngineError: refused); `run` then sends it. `want`: prompt log-probs and top
        alternatives to compute."""
        if not checked:
            self.validate(prompt, sampling, want)
        if self.released:
            raise EngineError(
                f"memory released ({', '.join(sorted(self.released))}): "
                "call /resume_memory_occupation first",
                503,
            )
        assert self._loop is not None and self._post is not None, "engine not started"
        post = self._post
        fut: asyncio.Future[GenRequest] = self._loop.create_future()
        req = GenRequest(rid=rid, prompt=list(prompt), sampling=sampling, want=want)
        if sampling.grammar is not None:
            req.grammar = self.grammars.matcher(*sampling.grammar)
        req.on_done = lambda r: post.post(_resolve, fut, r)
        if on_token is not None:
            req.on_token = lambda r: post.post(on_token, len(r.output_ids))
        with self._cv:
            if rid in self._inflight:
                raise EngineError(f"rid {rid!r}: a request with this id is already in flight")
            self._inflight[rid] = req
            self.counters["requests"] += 1
        return req, fut

    async def run(self, req: GenRequest, fut: asyncio.Future[GenRequest]) -> GenRequest:
        return (await self.run_many([(req, fut)]))[0]

    async def run_many(
        self, opened: list[tuple[GenRequest, asyncio.Future[GenRequest]]]
    ) -> list[GenRequest]:
        """Send opened requests to the step loop together (one lock, one wake-up) and
        wait for all of them. Cancelled (the client went away): abort the unfinished."""
        futs = [fut for _, fut in opened]
        try:
            for req, _ in opened:
                if req.sampling.max_new_tokens == 0 and not req.want.scores_prompt:
                    self.finish(req, FinishReason(type="length", length=0))
            await self._wait_open(futs)
            with self._cv:
                for req, _ in opened:
                    if not req.done:
                        req.submitted = True
                        self._waiting.append(req)
                self._cv.notify_all()
            return [await fut for fut in futs]
        except asyncio.CancelledError:  # free the slots
            for req, _ in opened:
                if not req.done:
                    msg = {"rid": req.rid, "message": "client disconnected"}
                    self._submit(Control("abort", msg))
            raise

    async def _wait_open(self, futs: list[asyncio.Future[GenRequest]]) -> None:
        """While paused, wait for `continue` (or for all these requests to be aborted)."""
        assert self._gate is not None
        while not self._gate.is_set() and not all(f.done() for f in futs):
            opened = asyncio.ensure_future(self._gate.wait())
            try:
                await asyncio.wait({opened, *futs}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()

    def finish(self, req: GenRequest, reason: FinishReason) -> None:
        """Mark `req` finished and wake its waiter (any thread)."""
        if req.done:
            return
        req.finish = reason
        req.weight_version = self.weight_version
        req.finished_at = time.monotonic()
        with self._cv:
            if self._inflight.get(req.rid) is req:
                del self._inflight[req.rid]
            if reason.type == "abort":
                self.counters["aborted"] += 1
        if req.on_done is not None:
            req.on_done(req)

    # ------------------------------------------------------------------ control
    async def abort(self, rid: str | None, message: str = "aborted by request") -> int:
        """Abort one request (unknown rid: no-op) or all (rid None); returns how many."""
        return int(await self._control("abort", rid=rid, message=message))

    async def pause(self, mode: PauseMode = "abort") -> int:
        assert self._gate is not None
        self._gate.clear()
        if mode == "abort":
            return await self.abort(None, "generation paused")
        await self._control("hold", mode=mode)
        return 0

    async def resume(self) -> None:
        assert self._gate is not None
        await self._control("release")
        self._gate.set()

    async def set_memory(self, release: bool, tags: frozenset[str]) -> str:
        """Release or resume the device memory named by `tags` (SGLang's
        weights / kv_cache / cuda_graph); while any is released, new requests are refused
        (503). Returns what moved."""
        done = str(await self._control("memory", release=release, tags=tags))
        self.released = (self.released | tags) if release else (self.released - tags)
        return done

    async def update_weights(self, path: str, version: str | None, abort_all: bool) -> int:
        """Load new weights between steps; with `abort_all` in-flight requests end first
        (partial output, finish_reason abort), else the reload waits for them."""
        return int(await self._control("reload", path=path, version=version, abort_all=abort_all))

    # ------------------------------------------------------------------ weights over the network
    async def init_weights_group(
        self, spec: GroupSpec, rank: int, timeout_s: float, join_timeout_s: float | None = None
    ) -> None:
        """Join the weight-update group `spec.group_name` as `rank` (blocks until every
        rank has joined; EngineError after `join_timeout_s`; `timeout_s` bounds each
        bucket's broadcast). Joining the group this server
        is already in, as the same rank, succeeds at once: a controller that lost track
        of it (restarted, or it saw this server fail) asks again."""
        async with self._group_lock:
            held = self.weight_groups.get(spec.group_name)
            if held is not None and held.spec == spec and held.rank == rank:
                return
            if held is not None:
                raise EngineError(
                    f"group_name {spec.group_name!r}: already joined as rank {held.rank} of "
                    f"{held.spec}"
                )
            if spec.backend == "nccl" and not self.opts.device.startswith("cuda"):
                raise EngineError("backend 'nccl' needs a CUDA server; this one runs on CPU")
            try:
                group = await asyncio.to_thread(
                    WeightGroup.join, spec, rank, timeout_s, None, None, join_timeout_s
                )
            except (RuntimeError, ValueError, OSError) as exc:  # c10d's errors are RuntimeErrors
                msg = f"failed to join weight group {spec.group_name!r}: {exc}"
                raise EngineError(msg) from None
            self.weight_groups[spec.group_name] = group

    async def destroy_weights_group(self, group_name: str) -> None:
        async with self._group_lock:
            group = self.weight_groups.pop(group_name, None)
        if group is None:
            raise EngineError(f"group_name {group_name!r}: no such weight group")
        group.close()

    def check_received(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Refuse a bucket that does not fit the model (before receiving any of it)."""
        own = self.model.state_dict()
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            if name not in own:
                raise EngineError(f"names: {name!r} is not a weight of this model")
            if list(own[name].shape) != list(shape):
                raise EngineError(
                    f"shapes: {name!r} is {list(shape)}, the model's is {list(own[name].shape)}"
                )
            try:
                parse_dtype(dt)
            except ValueError as exc:
                raise EngineError(f"dtypes: {name!r}: {exc}") from None

    async def update_weights_from_group(
        self,
        group_name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: str | None,
        abort_all: bool,
    ) -> int:
        """Receive one bucket by broadcast from rank 0 of `group_name`, then load it between
        steps as a reload does (`abort_all`: in-flight requests end first, else they
        drain; a paused engine keeps them)."""
        import torch

        self.check_received(names, dtypes, shapes)
        group = self.weight_groups.get(group_name)
        if group is None:
            raise EngineError(
                f"group_name {group_name!r}: not joined (call /init_weights_update_group first)"
            )
        device = self.opts.device if group.spec.backend == "nccl" else "cpu"
        bufs = [
            torch.empty(s, dtype=parse_dtype(d), device=device)
            for d, s in zip(dtypes, shapes, strict=True)
        ]
        async with self._group_lock:  # one bucket at a time: broadcasts pair up in order
            try:
                await asyncio.to_thread(group.broadcast, bufs)
            except RuntimeError as exc:
                msg = f"receiving the weights from {group_name!r} failed: {exc}"
                raise EngineError(msg) from None
        tensors = dict(zip(names, bufs, strict=True))
        return int(
            await self._control("reload", tensors=tensors, version=version, abort_all=abort_all)
        )

    async def set_weight_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            await self.abort(None, "weight version updated")
        self.weight_version = version

    def running_tokens(self) -> int:
        """Prompt + output tokens of the running batch (a snapshot; any thread)."""
        rows = list(self._core.rows) if self._core is not None else []
        return sum(len(r.prompt) + len(r.output_ids) for r in rows)

    def can_flush(self) -> bool:
        with self._cv:
            return not self._inflight

    def stats(self) -> EngineStats:
        now = time.monotonic()
        with self._cv:
            waiting = len(self._waiting)
            window = [(t, n) for t, n in self._rate if now - t <= self.opts.throughput_window_s]
            c = dict(self.counters)
        rate = sum(n for _, n in window) / self.opts.throughput_window_s if window else 0.0
        return EngineStats(
            running=self._n_running,
            waiting=waiting,
            paused=self.paused,
            weight_version=self.weight_version,
            gen_throughput=rate,
            generation_tokens_total=c["gen"],
            prompt_tokens_total=c["prompt"],
            requests_total=c["requests"],
            aborted_total=c["aborted"],
            weight_updates_total=c["updates"],
            prefill_batches_total=c["prefills"],
            decode_steps_total=c["steps"],
            last_error=self.last_error,
        )

    def note_tokens(self, generated: int, prompt: int = 0) -> None:
        """Called by the scheduler after each forward (a prefill when `prompt` > 0)."""
        now = time.monotonic()
        with self._cv:
            self.counters["gen"] += generated
            self.counters["prompt"] += prompt
            self.counters["prefills" if prompt else "steps"] += 1
            self._rate.append((now, generated))
            while self._rate and now - self._rate[0][0] > self.opts.throughput_window_s:
                self._rate.popleft()

    async def _control(self, kind: str, **args: Any) -> Any:
        ctl = Control(kind, args)
        self._submit(ctl)
        return await asyncio.wrap_future(ctl.result)

    def _submit(self, ctl: Control) -> None:
        with self._cv:
            if self._stopping:
                ctl.result.set_exception(EngineError("server is shutting down", 503))
                return
            self._controls.append(ctl)
            self._cv.notify_all()

    # ------------------------------------------------------------------ step-loop thread
    def num_waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def take_waiting(self, limit: int, token_budget: int) -> list[GenRequest]:
        """Pop up to `limit` queued requests whose padded prefill fits `token_budget`."""
        out: list[GenRequest] = []
        with self._cv:
            width = 0
            while self._waiting and len(out) < limit:
                nxt = self._waiting[0]
                w = max(width, len(nxt.prompt))
                if out and w * (len(out) + 1) > token_budget:
                    break
                width = w
                out.append(self._waiting.popleft())
        return out

    def find(self, rid: str) -> GenRequest | None:
        with self._cv:
            return self._inflight.get(rid)

    def unqueue(self, req: GenRequest) -> None:
        with self._cv:
            if req in self._waiting:
                self._waiting.remove(req)

    def drain_waiting(self) -> list[GenRequest]:
        with self._cv:
            out = list(self._waiting)
            self._waiting.clear()
        return out

    def _run(self) -> None:
        core = self._core
        assert self._post is not None
        while True:
            with self._cv:
                while not (self._stopping or self._controls or core.has_work(bool(self._waiting))):
                    self._cv.wait(timeout=1.0)
                if self._stopping:
                    break
                controls = list(self._controls)
                self._controls.clear()
            for ctl in controls:
                core.apply(ctl)
            try:
                core.tick()
            except Exception as exc:  # one bad step must not kill the server
                log.exception("engine step failed")
                self.last_error = f"{type(exc).__name__}: {exc}"
                core.abort_running(f"engine error: {self.last_error}")
            self._n_running = core.num_running()
            self._post.flush()
        core.abort_running("server is shutting down")
        for req in self.drain_waiting():
            self.finish(req, FinishReason(type="abort", message="server is shutting down"))
        self._post.flush()
        with self._cv:
            leftover = list(self._controls)
            self._controls.clear()
        for ctl in leftover:
            ctl.result.set_exception(EngineError("server is shutting down", 503))


def _resolve(fut: asyncio.Future[GenRequest], req: GenRequest) -> None:
    if not fut.done():
        fut.set_result(req)

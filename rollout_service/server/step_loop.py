"""The engine's step loop: the running batch, control commands and one tick.

Everything here runs on the engine's step-loop thread only; `Engine` is the thread-safe
front. A tick = (reload if one is due) → prefill and admit newly queued requests →
one decode step for the whole running batch.

Ticks and controls run in torch's inference mode: no tensor of the running batch ever
meets autograd, and dropping its bookkeeping (version counters, view tracking) makes
each of a decode step's small operations cheaper (a tenth of the step at 58 rows). The
batch's tensors are then inference tensors: written in place only from here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from areal_hex.api import PauseMode
from areal_hex.heap import trim_heap
from areal_hex.models import load_weights_in_place
from rollout_service.server import batching, decoder, grammar, sampling
from rollout_service.server.batching import KVBatch
from rollout_service.server.requests import (
    Control,
    EngineError,
    EngineOptions,
    GenRequest,
    TopEntry,
    check_stop,
)
from rollout_service.server.sampling import LogitShaping, SamplingTensors
from rollout_service.wire import FinishReason


class EngineSide(Protocol):
    """What the step loop uses of its engine (rollout_service.server.engine.Engine): the model,
    the waiting queue, and the calls that finish requests and count tokens."""

    opts: EngineOptions
    model: Any
    tokenizer: Any
    model_path: str
    weight_version: str
    counters: dict[str, int]
    load_model: Callable[[str], Any]

    def take_waiting(self, limit: int, token_budget: int) -> list[GenRequest]: ...

    def num_waiting(self) -> int: ...

    def find(self, rid: str) -> GenRequest | None: ...

    def unqueue(self, req: GenRequest) -> None: ...

    def drain_waiting(self) -> list[GenRequest]: ...

    def finish(self, req: GenRequest, reason: FinishReason) -> None: ...

    def note_tokens(self, generated: int, prompt: int = 0) -> None: ...


log = logging.getLogger(__name__)


def eos_ids(model: Any, tokenizer: Any | None) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(x) for x in src)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class Core:
    def __init__(self, engine: EngineSide) -> None:
        self.e = engine
        self.device = torch.device(engine.opts.device)
        self.batch: KVBatch | None = None
        self.rows: list[GenRequest] = []  # aligned with the batch's rows
        self.held = False  # paused with the running requests kept
        # held requests under "retract" get their KV cache recomputed if the weights change
        self.held_mode: PauseMode = "abort"
        self.pending_reload: Control | None = None
        self.eos = eos_ids(engine.model, engine.tokenizer)
        # the lean decode step of this model (None: HF's forward); rebuilt with the model
        self.decoder = decoder.for_model(engine.model)
        tok = engine.tokenizer
        self.pad_id = int(tok.pad_token_id) if tok is not None and tok.pad_token_id else 0
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(engine.opts.seed)
        self._decode_tail = (
            (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        )

    # ------------------------------------------------------------------ state
    def num_running(self) -> int:
        return len(self.rows)

    def has_work(self, waiting: bool) -> bool:
        if self.pending_reload is not None:
            return True
        if self.held:
            return False
        return bool(self.rows) or waiting

    # ------------------------------------------------------------------ controls
    @torch.inference_mode()
    def apply(self, ctl: Control) -> None:
        try:
            if ctl.kind == "abort":
                ctl.result.set_result(self.abort(ctl.args["rid"], ctl.args["message"]))
            elif ctl.kind == "hold":
                self.held = True
                self.held_mode = ctl.args["mode"]
                ctl.result.set_result(None)
            elif ctl.kind == "release":
                self.held = False
                self.held_mode = "abort"
                ctl.result.set_result(None)
            elif ctl.kind == "memory":
                ctl.result.set_result(self.memory(ctl.args["release"], ctl.args["tags"]))
            elif ctl.kind == "reload":
                n = 0
                if ctl.args["abort_all"]:
                    n = self.abort(None, "weights are being updated")
                if self.pending_reload is not None:  # a newer reload supersedes it
                    self.pending_reload.result.set_exception(
                        EngineError("superseded by a newer weight update")
                    )
                ctl.args["aborted"] = n
                self.pending_reload = ctl
            else:
                raise ValueError(f"unknown control {ctl.kind!r}")
        except Exception as exc:
            if not ctl.result.done():
                ctl.result.set_exception(exc)

    def memory(self, release: bool, tags: frozenset[str]) -> str:
        """Release (or take back) the device memory of the weights and the KV cache, as
        SGLang's colocated mode asks; only while no request is in flight. The weights go
        to host memory and back (on a CPU device they are there already); the KV cache
        exists only for running requests, so an idle engine holds none (the allocator's
        cached blocks are returned to the device)."""
        if self.rows or self.e.num_waiting():
            raise EngineError(
                f"{len(self.rows)} requests in flight: pause generation (mode abort) first"
            )
        done = []
        if "weights" in tags and self.device.type != "cpu":
            self.e.model.to("cpu" if release else self.device)
            self.decoder = decoder.for_model(self.e.model)  # its tables moved too
            done.append("weights")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            done.append("kv_cache")
        elif release and trim_heap():  # the freed KV buffers the server's kept heap holds
            done.append("freed heap")
        return ", ".join(done) or "nothing (CPU device: all of it is host memory)"

    def abort(self, rid: str | None, message: str) -> int:
        reason = FinishReason(type="abort", message=message)
        if rid is not None:
            req = self.e.find(rid)
            if req is None:
                return 0
            if req in self.rows:
                self._drop_rows([i for i, r in enumerate(self.rows) if r is req], reason)
            else:  # queued, or still waiting for `continue`
                self.e.unqueue(req)
                self.e.finish(req, reason)
            return 1
        queued = self.e.drain_waiting()
        n = len(self.rows) + len(queued)
        self._drop_rows(list(range(len(self.rows))), reason)
        for req in queued:
            self.e.finish(req, reason)
        return n

    @torch.inference_mode()
    def abort_running(self, message: str) -> None:
        self._drop_rows(list(range(len(self.rows))), FinishReason(type="abort", message=message))

    def _drop_rows(self, idx: list[int], reason: FinishReason) -> None:
        if not idx:
            return
        gone = set(idx)
        for i in idx:
            self.e.finish(self.rows[i], reason)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.batch = batching.select(self.batch, keep) if keep and self.batch else None

    # ------------------------------------------------------------------ one tick
    @torch.inference_mode()
    def tick(self) -> None:
        if self.pending_reload is not None:
            if self.rows and not self.held:  # drain in-flight requests, admit nothing new
                self._decode()
                return
            # Nothing running, or paused: held rows continue on the new weights after
            # `continue`, with their KV cache kept (in_place) or recomputed (retract).
            if self._reload(self.pending_reload) and self.rows and self.held_mode == "retract":
                self._recompute()
            self.pending_reload = None
        if self.held:
            return
        room = self.e.opts.max_running_requests - len(self.rows)
        if room > 0 and self._admit_now(room):
            admitted = self.e.take_waiting(room, self.e.opts.max_prefill_tokens)
            if admitted:
                self._prefill(admitted)
        if self.rows:
            self._decode()

    def _admit_now(self, room: int) -> bool:
        """Admit at once when nothing runs or everything waiting fits; otherwise wait
        until `admit_at_least` rows are free, so that a queue of requests joins the batch
        in a few prefills and merges rather than one per finished row (on a small model
        a prefill call costs about a decode step, whatever its size)."""
        return not self.rows or room >= self.e.opts.admit_at_least() or self.e.num_waiting() <= room

    def _reload(self, ctl: Control) -> bool:
        if ctl.args.get("tensors") is not None:
            return self._load_received(ctl)
        path, version = ctl.args["path"], ctl.args["version"]
        try:
            # Same architecture (the RL case): copy the tensors into the running model.
            same = load_weights_in_place(self.e.model, path)
            model = self.e.model if same else self.e.load_model(path)
        except Exception as exc:
            ctl.result.set_exception(EngineError(f"failed to load weights from {path}: {exc}"))
            return False
        old = self.e.model
        self.e.model = model
        self.e.model_path = path
        if version is not None:
            self.e.weight_version = version
        self.eos = eos_ids(model, self.e.tokenizer)
        if model is not old:
            self.decoder = decoder.for_model(model)
        del old
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.e.counters["updates"] += 1
        log.info("loaded weights from %s (version %s)", path, self.e.weight_version)
        ctl.result.set_result(ctl.args.get("aborted", 0))
        return True

    def _load_received(self, ctl: Control) -> bool:
        """One bucket received over the network (`/update_weights_from_distributed`):
        copy it into the running model. The version changes with the call that names one
        (the controller names it on a version's last bucket), so a version is counted once."""
        tensors: dict[str, torch.Tensor] = ctl.args["tensors"]
        own = self.e.model.state_dict()
        try:
            with torch.no_grad():
                for name, t in tensors.items():
                    own[name].copy_(t)
        except (KeyError, RuntimeError) as exc:
            msg = f"failed to load the received weights: {type(exc).__name__}: {exc}"
            ctl.result.set_exception(EngineError(msg))
            return False
        version = ctl.args["version"]
        if version is not None:
            self.e.weight_version = version
            self.e.counters["updates"] += 1
            log.info("received weights (version %s)", version)
        ctl.result.set_result(ctl.args.get("aborted", 0))
        return True

    def _recompute(self) -> None:
        """Rebuild the running batch's KV cache with the current weights: every row's
        prompt and output so far but its last token, which the next decode step feeds."""
        assert self.batch is not None
        seqs = [r.prompt + r.output_ids[:-1] for r in self.rows]
        try:
            new, _ = batching.prefill(
                self.e.model, seqs, self.batch.params, self.pad_id, self.decoder
            )
        except Exception as exc:
            self.abort_running(f"engine error recomputing the KV cache: {exc}")
            raise
        new.last = self.batch.last
        self.batch = new
        for r in self.rows:
            r.retractions += 1

    def _prefill(self, reqs: list[GenRequest]) -> None:
        for r in reqs:
            seed = r.sampling.sampling_seed
            if seed is not None and r.generator is None:
                r.generator = torch.Generator(device=self.device).manual_seed(seed % 2**64)
        prompts = [r.prompt for r in reqs]
        params = SamplingTensors.build([r.sampling for r in reqs], self.device)
        # prompt scoring needs the logits of more than the last prompt position
        keep = max(
            [len(r.prompt) - max(r.want.start, 1) + 1 for r in reqs if r.want.scores_prompt],
            default=1,
        )
        try:
            new, logits = batching.prefill_keep(
                self.e.model, prompts, params, self.pad_id, keep, self.decoder, shared=True
            )
        except Exception as exc:
            msg = f"engine error in prefill: {type(exc).__name__}: {exc}"
            for r in reqs:
                self.e.finish(r, FinishReason(type="abort", message=msg))
            raise
        if keep > 1:
            self._score_prompts(reqs, logits)
        if any(r.sampling.shapes_logits for r in reqs):
            rows = [(r.prompt, r.sampling) for r in reqs]
            params.shaping = LogitShaping.build(rows, logits.shape[-1], self.eos, self.device)
        tokens, logps, tops = self._sample(logits[:, -1], params, reqs)
        self.e.note_tokens(len(reqs), sum(len(p) for p in prompts))
        new.last = tokens
        keep = self._advance(reqs, tokens.tolist(), logps.tolist(), tops)
        if not keep:
            return
        if len(keep) < len(reqs):
            new = batching.select(new, keep)
        # buffers with a row for every request that may run, so later ones fit in; a
        # group's rows (views of one prefilled row) are copied into them once
        rows = self.e.opts.max_running_requests
        if self.batch is None:
            self.batch = batching.own(new, rows)
        else:
            self.batch = batching.admit(self.batch, new, rows)
        self.rows.extend(reqs[i] for i in keep)

    def _score_prompts(self, reqs: list[GenRequest], logits: torch.Tensor) -> None:
        """input_token_logprobs (and their top alternatives) of the requests that ask.
        logits: (B, K, V), the last K positions of each left-padded prompt."""
        for i, r in enumerate(reqs):
            if not r.want.scores_prompt:
                continue
            r.input_logprobs, r.input_top = sampling.prompt_logprobs(
                logits[i], r.prompt, r.want.start, r.sampling.temperature, r.want.top
            )

    def _sample(
        self, logits: torch.Tensor, params: SamplingTensors, reqs: list[GenRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, list[TopEntry] | None]:
        """One token per row (B, V) -> tokens (B,), their log-probs (B,), and each row's
        top alternatives when some row asks for them."""
        guided = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
        if guided:
            logits = grammar.apply(logits, guided)
        top = max((r.want.top for r in reqs), default=0)
        own = [r.generator for r in reqs] if any(r.generator is not None for r in reqs) else []
        if top == 0:
            tokens, logps = sampling.sample(logits, params, self.gen, own)
            tops = None
        else:
            tokens, logp = sampling.draw(logits, params, self.gen, own)
            logps = logp.gather(1, tokens[:, None]).squeeze(1)
            tops = [
                t[: r.want.top] for t, r in zip(sampling.top_entries(logp, top), reqs, strict=True)
            ]
        if params.shaping is not None:
            params.shaping.observe(tokens)
        if guided:
            drawn = tokens.tolist()
            for i, matcher in guided:
                matcher.consume_token(drawn[i])
        return tokens, logps, tops

    def _decode(self) -> None:
        assert self.batch is not None
        logits = batching.decode_step(self.e.model, self.batch, self.decoder)
        tokens, logps, tops = self._sample(logits, self.batch.params, self.rows)
        self.batch.last = tokens
        self.e.note_tokens(len(self.rows))
        keep = self._advance(self.rows, tokens.tolist(), logps.tolist(), tops)
        if not keep:
            self.rows, self.batch = [], None
        elif len(keep) < len(self.rows):
            # the rows that finished leave in place; the last rows take their slots
            self.rows = [self.rows[i] for i in batching.remove(self.batch, keep)]

    def _advance(
        self,
        reqs: list[GenRequest],
        tokens: list[int],
        logps: list[float],
        tops: list[TopEntry] | None,
    ) -> list[int]:
        """Append one token per request; finish those that stop. Returns live indices."""
        keep: list[int] = []
        for i, (req, tok, lp) in enumerate(zip(reqs, tokens, logps, strict=True)):
            if req.sampling.max_new_tokens == 0:  # prompt scoring only (after prefill)
                self.e.finish(req, FinishReason(type="length", length=0))
                continue
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            req.versions.append(self.e.weight_version)
            if tops is not None and req.want.top:
                req.output_top.append(tops[i])
            reason = check_stop(req, tok, self.eos, self._decode_tail)
            if reason is None:
                keep.append(i)
                if req.on_token is not None:
                    req.on_token(req)
            else:
                self.e.finish(req, reason)
        return keep

"""Async HTTP client for one inference server: ours or a real SGLang server.

Implements `areal_hex.api.GenerationClient` using only the part of the SGLang native API
that both servers share (docs/api.md), so the same code drives both. With an API key it sends
`Authorization: Bearer <key>` on every call (SGLang's `--api-key` expects the same).

    async with InferenceClient("http://127.0.0.1:30000", api_key=key) as c:
        res = await c.generate(prompt_ids, SamplingParams(max_new_tokens=32), rid="p0-s1")
        res.output_ids, res.logprobs, res.finish_reason, res.weight_version
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from operator import itemgetter
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import pydantic

from areal_hex.api import GenerateResult, PauseMode, SamplingParams
from areal_hex.http_lane import HttpLane, LaneError
from areal_hex.net import async_wait_until
from areal_hex.weight_net import BucketSpec, GroupSpec
from rollout_service import wire

T = TypeVar("T")


# Idle connections are dropped before the server closes them (uvicorn, SGLang's server
# too, closes a keep-alive connection after 5 s idle): a request sent on one the server
# is closing fails with ServerDisconnectedError, and the one retry may pick another.
KEEPALIVE_S = 4.0
CONNECT_S = 10.0  # to open a connection, within a call's total timeout


class GenerationError(RuntimeError):
    """A call the server refused or could not answer. `status` is None when the server
    could not be reached (connection refused, timeout): worth a retry elsewhere."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        where = f"{url} (HTTP {status})" if status is not None else url
        super().__init__(f"{where}: {message}")
        self.url = url
        self.status = status
        self.message = message


@dataclass
class Response:
    """A read HTTP response (aiohttp's is only valid while its connection is held)."""

    status_code: int
    content: bytes
    reason_phrase: str = ""

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _message(resp: Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:500]


def parse_generate(body: Any) -> GenerateResult:
    """A `/generate` response (one request, `return_logprob: true`) as a GenerateResult."""
    return generate_result(wire.GenerateOutput.model_validate(body))


# A batch response read straight from its bytes by pydantic's own JSON parser: a third
# of the CPU of `json.loads` and then validating each result (16 results of 24 tokens).
_OUTPUTS = pydantic.TypeAdapter(list[wire.GenerateOutput])


def generate_result(out: wire.GenerateOutput) -> GenerateResult:
    """One validated `/generate` result as a GenerateResult."""
    meta = out.meta_info
    pairs = meta.output_token_logprobs
    if pairs is None:
        raise ValueError("response has no meta_info.output_token_logprobs (return_logprob?)")
    logprobs = _floats(list(map(itemgetter(0), pairs)))
    # some servers omit output_ids: the ids are in the log-prob tuples
    output_ids = out.output_ids or [int(p[1]) for p in pairs]
    if len(logprobs) != len(output_ids):
        raise ValueError(f"{len(logprobs)} log-probs for {len(output_ids)} output tokens")
    finish = meta.finish_reason or {}
    versions = meta.output_token_versions
    if versions is not None and len(versions) != len(output_ids):
        raise ValueError(f"{len(versions)} token versions for {len(output_ids)} output tokens")
    return GenerateResult(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=str(finish.get("type") or "abort"),
        weight_version=wire.version_from_wire(meta.weight_version),
        prompt_tokens=meta.prompt_tokens,
        token_versions=None if versions is None else _versions(versions),
    )


# A response carries a few values per token: the usual ones (float log-probs, versions
# all ints or all strings) are converted at C speed rather than by a Python call per
# token; anything else one by one, as before.


def _floats(values: list[Any]) -> list[float]:
    return values if set(map(type, values)) <= {float} else [float(v) for v in values]


def _versions(values: list[Any]) -> list[int | None]:
    kinds = set(map(type, values))
    if kinds <= {int}:
        return values
    if kinds <= {str}:  # our server's: the version of each token as a string
        table = {v: wire.version_from_wire(v) for v in set(values)}
        return list(map(table.__getitem__, values))
    return [wire.version_from_wire(v) for v in values]


class InferenceClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float | None = 120.0,
        update_timeout_s: float | None = 600.0,
        max_inflight: int = 128,
    ) -> None:
        """`max_inflight`: `/generate` calls sent at once; the rest wait here, in order.
        A server runs at most its `max_running_requests` anyway. The transport is aiohttp:
        with a few hundred open connections httpx's pool scans them all on every request
        and cost the controller more CPU than the generation cost the server."""
        if max_inflight <= 0:
            raise ValueError(f"InferenceClient: max_inflight must be > 0, got {max_inflight}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.update_timeout_s = update_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Room for every generate call plus the control calls (pause, abort, reload), so
        # a pause is never queued behind the generate calls it is meant to stop.
        self._max_connections = max_inflight + 8
        self._session: aiohttp.ClientSession | None = None  # made on first use, in a loop
        self._slots = asyncio.Semaphore(max_inflight)
        # POSTs over plain http (`/generate`, made per group, and the weight updates' calls)
        # take the lean transport
        plain = self.base_url.startswith("http://")
        self._lane = HttpLane(self.base_url, self._headers, KEEPALIVE_S) if plain else None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=KEEPALIVE_S
                ),
                json_serialize=json.dumps,
            )
        return self._session

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ transport
    async def _call(
        self, method: str, path: str, body: Any = None, timeout: float | None | object = ...
    ) -> Response:
        total = self.timeout_s if timeout is ... else timeout
        if method == "POST" and self._lane is not None:
            return await self._post_lane(path, body, total)
        kwargs: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=total, connect=CONNECT_S)}
        if body is not None:
            kwargs["json"] = body
        url = self.base_url + path
        for attempt in range(2):
            try:
                async with self._http().request(method, url, **kwargs) as r:
                    resp = Response(r.status, await r.read(), r.reason or "")
                break
            except aiohttp.ServerDisconnectedError as exc:
                # A keep-alive connection the server closed just as it was reused: the
                # request never ran (the server aborts requests whose client went away).
                if attempt == 0:
                    continue
                raise GenerationError(url, f"{type(exc).__name__}: {exc}") from exc
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise GenerationError(url, f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            raise GenerationError(url, _message(resp), resp.status_code)
        return resp

    async def _json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        resp = await self._call(method, path, body, **kw)
        return resp.json() if resp.content else {}

    # ------------------------------------------------------------------ generation
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateResult:
        """One request with behaviour log-probs; an aborted request returns normally
        with `finish_reason == "abort"` and the tokens generated so far."""
        resp = await self._generate(list(input_ids), sampling, rid)
        return self._parsed(
            lambda: generate_result(wire.GenerateOutput.model_validate_json(resp.content))
        )

    async def generate_batch(
        self, input_ids: list[list[int]], sampling: SamplingParams, rids: list[str]
    ) -> list[GenerateResult]:
        """Several requests in one `/generate` call (SGLang's batch form: one rid per
        request); each result as `generate` returns it. Takes one in-flight slot.

        A group (one prompt n times) goes as n copies of the prompt, never as one request
        with `sampling_params.n`: SGLang gives parallel samples random ids, so only the
        batch form lets `abort(rid)` reach each sample (SGLang's prefix cache and our
        engine's shared prefill keep the repeated prompt cheap)."""
        resp = await self._generate([list(x) for x in input_ids], sampling, list(rids))

        def parse() -> list[GenerateResult]:
            outs = _OUTPUTS.validate_json(resp.content)
            if len(outs) != len(input_ids):
                raise ValueError(f"expected a list of {len(input_ids)} results")
            return [generate_result(o) for o in outs]

        return self._parsed(parse)

    async def _generate(self, input_ids: Any, sampling: SamplingParams, rid: Any) -> Response:
        params = sampling.to_wire()
        payload: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": params,
            "return_logprob": True,
        }
        if rid is not None:
            payload["rid"] = rid
        async with self._slots:
            return await self._call("POST", "/generate", payload)

    async def _post_lane(self, path: str, body: Any, total: float | None) -> Response:
        """`_call("POST", path, body)` over the lean transport (areal_hex/http_lane.py): the same
        total timeout, errors and one resend of a request the server did not take."""
        url = self.base_url + path
        assert self._lane is not None
        data = b"" if body is None else json.dumps(body).encode()
        try:
            post = self._lane.post(path, data, CONNECT_S)
            status, reason, content = await asyncio.wait_for(post, total)
        except (LaneError, OSError, asyncio.TimeoutError) as exc:
            raise GenerationError(url, f"{type(exc).__name__}: {exc}") from exc
        resp = Response(status, content, reason)
        if status >= 400:
            raise GenerationError(url, _message(resp), status)
        return resp

    def _parsed(self, parse: Callable[[], T]) -> T:
        try:
            return parse()
        except (ValueError, TypeError, KeyError, IndexError, pydantic.ValidationError) as exc:
            raise GenerationError(self.base_url + "/generate", f"bad response: {exc}") from exc

    async def generate_raw(self, payload: dict[str, Any]) -> Any:
        """POST any `/generate` body; returns the decoded JSON (object or list)."""
        return await self._json("POST", "/generate", payload)

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid, or every request when `rid` is None."""
        body = {"rid": rid} if rid is not None else {"abort_all": True}
        await self._json("POST", "/abort_request", body)

    # ------------------------------------------------------------------ weights, control
    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = True
    ) -> None:
        body = {
            "model_path": model_path,
            "weight_version": wire.version_to_wire(weight_version),
            "abort_all_requests": abort_all_requests,
        }
        out = await self._json(
            "POST", "/update_weights_from_disk", body, timeout=self.update_timeout_s
        )
        if isinstance(out, dict) and out.get("success") is False:
            raise GenerationError(
                self.base_url + "/update_weights_from_disk", str(out.get("message"))
            )

    async def init_weights_update_group(self, group: GroupSpec, rank_offset: int) -> None:
        """Join the weight-update group as rank `rank_offset` (returns once every rank has
        joined: call all servers at once, while the trainer joins as rank 0)."""
        body = {**asdict(group), "rank_offset": rank_offset}
        await self._weights_call("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        bucket: BucketSpec,
        group_name: str,
        weight_version: int | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Receive one bucket by broadcast from the trainer and load it; returns once
        loaded. `weight_version` (on a version's last bucket) becomes the server's."""
        body: dict[str, Any] = {
            "names": bucket.names,
            "dtypes": bucket.dtypes,
            "shapes": bucket.shapes,
            "group_name": group_name,
            "flush_cache": True,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = wire.version_to_wire(weight_version)
        await self._weights_call("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._weights_call("/destroy_weights_update_group", {"group_name": group_name})

    async def _weights_call(self, path: str, body: dict[str, Any]) -> None:
        out = await self._json("POST", path, body, timeout=self.update_timeout_s)
        if isinstance(out, dict) and out.get("success") is False:
            raise GenerationError(self.base_url + path, str(out.get("message")))

    async def update_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        body = {
            "new_version": wire.version_to_wire(version),
            "abort_all_requests": abort_all_requests,
        }
        await self._json("POST", "/update_weight_version", body)

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation; mode `abort` returns once nothing is in flight."""
        await self._json("POST", "/pause_generation", {"mode": mode}, timeout=self.update_timeout_s)

    async def resume(self) -> None:
        await self._json("POST", "/continue_generation", {})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Give the device memory named by `tags` back (all of it when None); refused
        while requests are in flight. Returns what the server says it moved."""
        body = {} if tags is None else {"tags": tags}
        out = await self._json("POST", "/release_memory_occupation", body)
        return str(out.get("message", ""))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Take the memory released by `release_memory_occupation` back."""
        body = {} if tags is None else {"tags": tags}
        out = await self._json("POST", "/resume_memory_occupation", body)
        return str(out.get("message", ""))

    async def flush_cache(self, retries: int = 20, delay_s: float = 0.5) -> None:
        """Flush the prefix cache; the server refuses while requests run, so retry."""
        for attempt in range(retries + 1):
            try:
                await self._call("POST", "/flush_cache")
                return
            except GenerationError as exc:
                if exc.status != 400 or attempt == retries:
                    raise
                await asyncio.sleep(delay_s)

    # ------------------------------------------------------------------ info
    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout=5.0)
        except GenerationError:
            return False
        return True

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            await self._call("GET", "/health_generate", timeout=timeout_s)
        except GenerationError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 60.0, interval_s: float = 0.5) -> None:
        if not await async_wait_until(self.health, timeout_s, interval_s=interval_s):
            raise GenerationError(self.base_url, f"not healthy after {timeout_s:.0f} s")

    async def model_info(self) -> dict[str, Any]:
        return dict(await self._json("GET", "/get_model_info"))

    async def server_info(self) -> dict[str, Any]:
        return dict(await self._json("GET", "/get_server_info"))

    async def weight_version(self) -> int | None:
        return wire.version_from_wire((await self.model_info()).get("weight_version"))

    async def metrics_text(self) -> str:
        return (await self._call("GET", "/metrics")).text

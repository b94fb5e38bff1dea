"""Each SGLang sampling and log-prob field of the built-in server against a reference
computed here: greedy decoding re-done step by step with full forward passes of the
same tiny model and a hand-written logits transform (penalties, logit bias,
min_new_tokens), prompt log-probs from one plain forward, stop trimming from the
untrimmed output."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import load_model, load_tokenizer, materialize
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(180)
PROMPT = [30, 31, 32, 33, 30, 31]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fields")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=3), root / "v0")
    return root


@pytest.fixture(scope="module")
def model(weights: Path) -> Any:
    return load_model(weights / "v0", "cpu", "float32")


@pytest.fixture(scope="module")
def url(weights: Path) -> Any:
    inf = InferenceConfig(weights_dir=str(weights), context_length=128)
    with ServerThread(build_server_app(ModelConfig(path=str(weights / "v0")), inf)) as u:
        yield u


def gen(url: str, body: dict[str, Any], status: int = 200) -> Any:
    resp = httpx.post(url + "/generate", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


Shape = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def greedy_reference(model: Any, prompt: list[int], steps: int, shape: Shape) -> tuple[list, list]:
    """Greedy tokens and their log-probs (T = 1), each step a full forward over prompt +
    output so far, the last logits passed through `shape(logits, prompt, out)`."""
    out: list[int] = []
    lps: list[float] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        logits = shape(logits.clone(), prompt, out)
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(logits.argmax())
        out.append(tok)
        lps.append(float(logp[tok]))
    return out, lps


def penalized(freq: float, pres: float, rep: float, bias: dict[int, float]) -> Shape:
    """SGLang's order: frequency/presence over output tokens, repetition over prompt and
    output tokens, then the logit bias."""

    def shape(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        for tok in set(out):
            logits[tok] -= freq * out.count(tok) + pres
        for tok in set(prompt) | set(out):
            logits[tok] = logits[tok] / rep if logits[tok] > 0 else logits[tok] * rep
        for tok, b in bias.items():
            logits[tok] += b
        return logits

    return shape


def plain(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
    return logits


GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}


def ids_and_lps(res: dict[str, Any]) -> tuple[list[int], list[float]]:
    pairs = res["meta_info"]["output_token_logprobs"]
    return res["output_ids"], [p[0] for p in pairs]


@pytest.mark.parametrize(
    ("freq", "pres", "rep", "bias"),
    [
        (1.5, 0.0, 1.0, {}),
        (0.0, 2.0, 1.0, {}),
        (0.0, 0.0, 1.8, {}),
        (0.7, 0.4, 1.3, {}),
        (0.0, 0.0, 1.0, {40: 5.0, 41: 4.0}),
        (-1.0, 0.0, 0.6, {}),  # negative / below-1 values reward repeats
    ],
)
def test_penalties_and_bias_match_a_hand_written_transform(
    url: str, model: Any, freq: float, pres: float, rep: float, bias: dict[int, float]
) -> None:
    sp = {
        **GREEDY,
        "frequency_penalty": freq,
        "presence_penalty": pres,
        "repetition_penalty": rep,
        "logit_bias": {str(k): v for k, v in bias.items()},
    }
    # the penalized request shares a batch with a plain one (neutral rows stay plain)
    both = gen(
        url,
        {
            "input_ids": [PROMPT, PROMPT[:4]],
            "sampling_params": [sp, GREEDY],
            "return_logprob": True,
        },
    )
    ref_ids, ref_lps = greedy_reference(model, PROMPT, 12, penalized(freq, pres, rep, bias))
    plain_ids, plain_lps = greedy_reference(model, PROMPT[:4], 12, plain)
    got_ids, got_lps = ids_and_lps(both[0])
    assert got_ids == ref_ids
    assert got_lps == pytest.approx(ref_lps, abs=1e-4)
    assert ids_and_lps(both[1])[0] == plain_ids
    assert ids_and_lps(both[1])[1] == pytest.approx(plain_lps, abs=1e-4)
    unpenalized = greedy_reference(model, PROMPT, 12, plain)
    changed = ref_ids != unpenalized[0] or ref_lps != pytest.approx(unpenalized[1], abs=1e-3)
    assert changed  # the field changes the output: the test can fail


def test_min_new_tokens_keeps_stop_tokens_out(url: str, model: Any) -> None:
    free = gen(url, {"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"]
    stop = free[1]
    first = free.index(stop)
    sp = {**GREEDY, "stop_token_ids": [stop]}
    early = gen(url, {"input_ids": PROMPT, "sampling_params": sp})
    assert early["output_ids"] == free[: first + 1]
    held = gen(url, {"input_ids": PROMPT, "sampling_params": {**sp, "min_new_tokens": 6}})

    def masked(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        if len(out) < 6:
            logits[stop] = float("-inf")
        return logits

    ref, _ = greedy_reference(model, PROMPT, 12, masked)
    end = ref.index(stop, 6) + 1 if stop in ref[6:] else len(ref)
    assert held["output_ids"] == ref[:end]
    assert stop not in held["output_ids"][:6] and len(held["output_ids"]) >= 6


def test_n_samples_one_request(url: str, model: Any) -> None:
    sp = {"max_new_tokens": 6, "ignore_eos": True, "n": 3}
    res = gen(url, {"input_ids": PROMPT, "sampling_params": sp, "rid": "g", "return_logprob": True})
    assert isinstance(res, list) and len(res) == 3
    assert [r["meta_info"]["id"] for r in res] == ["g_0", "g_1", "g_2"]
    for r in res:  # every sample's log-probs are those of the model
        ids, lps = ids_and_lps(r)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])
        assert lps == pytest.approx(ref.squeeze(1).tolist(), abs=1e-4)
    assert len({tuple(r["output_ids"]) for r in res}) > 1  # independent draws

    batch = gen(
        url,
        {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {**sp, "n": 2}, "rid": ["a", "b"]},
    )
    assert [r["meta_info"]["id"] for r in batch] == ["a_0", "a_1", "b_0", "b_1"]
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [6, 6, 2, 2]
    greedy = gen(url, {"input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 2}})
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"]

    mixed = {
        "input_ids": [PROMPT, PROMPT],
        "sampling_params": [{"n": 2, "max_new_tokens": 2}, {"n": 3, "max_new_tokens": 2}],
    }
    assert "same for every prompt" in gen(url, mixed, 400)["error"]["message"]
    streamed = {"input_ids": PROMPT, "sampling_params": sp, "stream": True}
    assert "stream" in gen(url, streamed, 400)["error"]["message"]


def test_greedy_below_1e_6(url: str) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True}
    zero = gen(url, {**body, "sampling_params": GREEDY})
    for t in (1e-7, 5e-7):
        tiny = gen(url, {**body, "sampling_params": {**GREEDY, "temperature": t}})
        assert tiny["output_ids"] == zero["output_ids"]
        lps = [p[0] for p in tiny["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx([p[0] for p in zero["meta_info"]["output_token_logprobs"]])


def test_stop_trimming(url: str, weights: Path) -> None:
    tok = load_tokenizer(weights / "v0")
    free = gen(url, {"text": "ab=", "sampling_params": GREEDY})
    ids = free["output_ids"]
    stop_id = ids[2]
    sp = {**GREEDY, "stop_token_ids": [stop_id], "skip_special_tokens": False}
    cut = ids.index(stop_id)
    trimmed = gen(url, {"text": "ab=", "sampling_params": sp})
    assert trimmed["output_ids"] == ids[: cut + 1]  # the ids keep the stop token
    assert trimmed["text"] == tok.decode(ids[:cut], skip_special_tokens=False)
    kept = gen(url, {"text": "ab=", "sampling_params": {**sp, "no_stop_trim": True}})
    assert kept["text"] == tok.decode(ids[: cut + 1], skip_special_tokens=False)

    word = free["text"][3:5]
    at = free["text"].index(word)
    by_text = gen(url, {"text": "ab=", "sampling_params": {**GREEDY, "stop": [word]}})
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert by_text["text"] == free["text"][:at]
    untrimmed = {**GREEDY, "stop": [word], "no_stop_trim": True}
    assert gen(url, {"text": "ab=", "sampling_params": untrimmed})["text"].endswith(word)


def prompt_reference(model: Any, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[j] | prompt[:j]) rows: (len - 1, V), row j-1 predicts prompt[j]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_match_a_plain_forward(url: str, model: Any, weights: Path) -> None:
    tok = load_tokenizer(weights / "v0")
    long = [40 + (i * 7) % 50 for i in range(19)]
    body = {
        "input_ids": [PROMPT, long],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": [0, 5],
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    res = gen(url, body)
    for prompt, start, r in zip([PROMPT, long], [0, 5], res, strict=True):
        meta = r["meta_info"]
        assert r["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
        ref = prompt_reference(model, prompt)
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:]
        assert [e[2] for e in entries] == [tok.decode([t]) for t in prompt[start:]]
        # the first scored position has no log-prob, whatever the start (as SGLang)
        first = start + 1
        want = ref[first - 1 :].gather(1, torch.tensor(prompt[first:])[:, None]).squeeze(1)
        got = [e[0] for e in entries]
        assert got[0] is None and meta["input_top_logprobs"][0] is None
        assert got[1:] == pytest.approx(want.tolist(), abs=1e-4)
        tops = [t for t in meta["input_top_logprobs"] if t is not None]
        vals, idx = ref[first - 1 :].topk(3, dim=-1)
        assert [[e[1] for e in t] for t in tops] == idx.tolist()
        got_vals = [e[0] for t in tops for e in t]
        assert got_vals == pytest.approx(vals.flatten().tolist(), abs=1e-4)

    # output top log-probs: greedy, so the first alternative is the drawn token
    out = gen(
        url,
        {
            "input_ids": PROMPT,
            "sampling_params": GREEDY,
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )["meta_info"]
    for pair, top in zip(out["output_token_logprobs"], out["output_top_logprobs"], strict=True):
        assert len(top) == 2 and top[0][1] == pair[1] and top[0][0] == pytest.approx(pair[0])
        assert top[1][0] <= top[0][0] and top[0][2] is None
    assert out["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only
    too_far = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 6}
    assert "logprob_start_len" in gen(url, too_far, 400)["error"]["message"]


def test_info_routes(url: str) -> None:
    info = httpx.get(url + "/model_info").json()
    assert info == httpx.get(url + "/get_model_info").json() and info["weight_version"] == "0"
    server = httpx.get(url + "/server_info").json()
    assert server["version"] and server["context_length"] == 128
    assert info["model_type"] == "qwen3" and info["preferred_sampling_params"] is None
    assert info["has_image_understanding"] is False and info["has_audio_understanding"] is False
    before = time.time()
    load = httpx.get(url + "/get_load").json()
    assert before <= load[0].pop("ts_tic") <= time.time()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_constrained_decoding(url: str) -> None:
    """regex, json_schema and ebnf (llguidance): sampled at T = 1, every output obeys its
    grammar and ends with a stop (the grammar's end), not the length limit."""
    import json as jsonlib
    import re

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 22, 333]}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    cases = [
        ({"regex": "[0-9]{3}-[a-c]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t)),
        (
            {"json_schema": jsonlib.dumps(schema)},
            lambda t: jsonschema.validate(jsonlib.loads(t), schema) or True,
        ),
        ({"ebnf": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
    ]
    for grammar, ok in cases:
        sp = {"max_new_tokens": 100, "n": 4, **grammar}
        for r in gen(url, {"text": "q:", "sampling_params": sp}):
            assert r["meta_info"]["finish_reason"]["type"] == "stop", (grammar, r)
            assert ok(r["text"]), (grammar, r["text"])
    short = {"max_new_tokens": 4}
    bad = gen(url, {"text": "q", "sampling_params": {**short, "regex": "(unclosed"}}, 400)
    assert "sampling_params.regex" in bad["error"]["message"]
    bad = gen(url, {"text": "q", "sampling_params": {**short, "json_schema": "{not json"}}, 400)
    assert "sampling_params.json_schema" in bad["error"]["message"]
    two = gen(url, {"text": "q", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, 400)
    assert "at most one" in two["error"]["message"]

"""lm-evaluation-harness's stock `local-completions` model against the built-in server,
offline, on tiny local tasks (tests/data/lm_eval_tiny): loglikelihood (multiple choice),
loglikelihood_rolling and generate_until all run, and each choice's log-likelihood is
the one `/generate` prompt scoring gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import load_tokenizer, materialize
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(300)
TASKS = Path(__file__).parents[1] / "data" / "lm_eval_tiny"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=2), root / "v0")
    return root


@pytest.fixture(scope="module")
def url(weights: Path) -> Any:
    inf = InferenceConfig(context_length=256)
    with ServerThread(build_server_app(ModelConfig(path=str(weights / "v0")), inf)) as u:
        yield u


def scored(url: str, context: list[int], continuation: list[int]) -> float:
    """The continuation's log-likelihood by SGLang-style prompt scoring."""
    body = {
        "input_ids": context + continuation,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": len(context) - 1,  # its first entry is null, as in SGLang
    }
    meta = httpx.post(url + "/generate", json=body, timeout=60).json()["meta_info"]
    return sum(e[0] for e in meta["input_token_logprobs"][1:])


def test_local_completions_runs_local_tasks(
    url: str, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_dir = str(weights / "v0")
    args = (
        f"base_url={url}/v1/completions,model={model_dir},tokenizer={model_dir},"
        "tokenizer_backend=huggingface,max_retries=1,max_length=256"
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=["areal_hex_arith_mc", "areal_hex_arith_gen", "areal_hex_arith_rolling"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
    )
    assert out is not None
    results = out["results"]
    assert 0.0 <= results["areal_hex_arith_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["areal_hex_arith_gen"]["exact_match,none"] <= 1.0
    assert results["areal_hex_arith_rolling"]["word_perplexity,none"] > 1.0

    tok = load_tokenizer(model_dir)
    samples = out["samples"]["areal_hex_arith_mc"]
    assert len(samples) == 4
    for s in samples:
        doc = s["doc"]
        context = tok.encode(doc["question"], add_special_tokens=False)
        for choice, resp in zip(doc["choices"], s["resps"], strict=True):
            loglik = resp[0][0]
            want = scored(url, context, tok.encode(choice, add_special_tokens=False))
            assert loglik == pytest.approx(want, abs=1e-4)
    gens = [s["resps"][0][0] for s in out["samples"]["areal_hex_arith_gen"]]
    assert len(gens) == 4 and all(isinstance(g, str) for g in gens)

"""The /generate response encoder: the standard library's JSON, value for value."""

from __future__ import annotations

import json
import math
import random

from rollout_service.server.http_common import FastJSON


def test_fast_json_decodes_to_the_same_values_as_the_standard_encoder() -> None:
    rng = random.Random(0)
    body = [
        {
            "text": '13 + 4 = 17\n#### 17 é \u2028 "q" \\',
            "output_ids": [rng.randrange(100) for _ in range(20)],
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": 2},
                "e2e_latency": rng.random(),
                "output_token_logprobs": [[-rng.random() * 10**-k, 7, None] for k in range(12)],
                "output_token_versions": ["7", 8],
                "flags": [True, False, -0.0, 1e300, 5e-324],
            },
        }
    ]
    raw = FastJSON(body).body
    # every float back bit for bit (== on floats is exact), every string unescaped alike
    assert json.loads(raw) == body == json.loads(json.dumps(body))
    assert "\u2028".encode() in raw  # UTF-8 as is, as the standard response (ensure_ascii off)


def test_values_without_a_json_form_become_null() -> None:
    assert json.loads(FastJSON([math.nan, math.inf, -math.inf, 1.5]).body) == [None] * 3 + [1.5]

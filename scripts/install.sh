#!/usr/bin/env bash
# Install areal-hex and everything it needs into ./.venv (CPU; no GPU required).
# Usage: bash scripts/install.sh        (then: source .venv/bin/activate)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -d .venv ] || python3 -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
# torch first and pinned: a bare `torch` requirement would pull several GB of CUDA wheels.
pip install -q torch==2.13.0
# deepspeed ships as an sdist whose build imports torch: build it against the torch above.
pip install -q --no-build-isolation "deepspeed>=0.16"
# DeepSpeed compiles its CPU shared-memory comm op on first use; compile it now, into the
# environment (where the trainer looks: trainer_service/engine.py cpu_environment), while
# the rest installs, rather than in the first trainer that starts.
( DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions" python -c \
    "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" \
    > .venv/deepspeed-op-build.log 2>&1 ) &
op_build=$!
pip install -q -e ".[dev]"
# the project's own bytecode, now: an editable install compiles nothing, and where
# PYTHONDONTWRITEBYTECODE is set every process of a run would compile the modules it
# imports at each start (about 0.1 s of CPU in each of the launcher, the controller and
# the fork server: docs/running.md, start-up, fifth pass)
python -m compileall -q areal_hex hexctl rollout_service trainer_service scheduler
if ! wait "$op_build"; then
  echo "DeepSpeed's CPU comm op not compiled now (it will be on first use):" \
    "see .venv/deepspeed-op-build.log" >&2
fi
echo "installed: $(python -c 'import areal_hex; print("areal-hex", areal_hex.__version__)')"

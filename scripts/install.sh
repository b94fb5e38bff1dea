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
pip install -q -e ".[dev]"
echo "installed: $(python -c 'import areal_hex; print("areal-hex", areal_hex.__version__)')"

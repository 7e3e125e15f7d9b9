#!/usr/bin/env bash
# Install stalwart into .venv and run the quickstart: 4 workers, one killed at step 60 and
# recovered in place. Works on a fresh machine with Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: a looser resolution would download several GB of CUDA wheels.
python -m pip install -q torch==2.13.0
python -m pip install -q -e .
exec stalwart run examples/quickstart.yaml "$@"

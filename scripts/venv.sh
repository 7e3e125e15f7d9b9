# Sourced by quickstart.sh and test.sh: create .venv with Python 3.11 and install stalwart
# with the extras named in $EXTRAS, e.g. "[test]" (pinned versions from pyproject.toml).
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: a looser resolution would download several GB of CUDA wheels.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".${EXTRAS:-}"

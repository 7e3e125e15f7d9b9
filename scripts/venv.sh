# Sourced by quickstart.sh and test.sh: create .venv with Python 3.11 and install stalwart
# with the extras named in $EXTRAS, e.g. "[test]", at the versions CI tests: pyproject.toml
# states the ranges stalwart supports, constraints.txt pins what is tested.
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch is pinned there too: a looser resolution would download several GB of CUDA wheels.
python -m pip install -q -c constraints.txt -e ".${EXTRAS:-}"

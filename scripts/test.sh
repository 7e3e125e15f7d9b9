#!/usr/bin/env bash
# Install everything the tests need (Debian's prometheus package included) and run the whole
# suite. Used verbatim by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's: prometheus (promtool); for the network-namespace cluster of the network faults
# (orchestrator/chaos/netns.py) iproute2 (ip) and nftables (nft); redis-server for the GCS
# fault tolerance of the restart_gcs scenarios (orchestrator/chaos/ray_faults.py).
if ! command -v promtool >/dev/null || ! command -v nft >/dev/null || ! command -v ip >/dev/null \
  || ! command -v redis-server >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus iproute2 nftables \
    redis-server >/dev/null
fi
EXTRAS='[test,report,grafana]' . scripts/venv.sh
# stalwart's own modules compiled once: an editable install leaves them as source, and where
# PYTHONDONTWRITEBYTECODE is set every rank, agent and supervisor process of every job
# compiled them again (~0.1 s of CPU per process, ~700 processes in the suite).
python -m compileall -q -j 0 orchestrator health ckpt dashboards stalwart examples tests bench \
  >/dev/null
ruff check .
ruff format --check .
# Which machine, and how fast: the suite's time scales with it (docs/benchmarks.md).
python scripts/machine.py || true
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"

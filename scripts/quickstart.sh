#!/usr/bin/env bash
# Install stalwart into .venv and run the quickstart: 4 workers, one killed at step 60 and
# recovered in place. Works on a fresh machine with Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
exec stalwart run examples/quickstart.yaml "$@"

#!/usr/bin/env bash
# Build the offline Python bundle that bench/gpu_device_run.sh unpacks on a GPU machine that
# has torch but no network, no Ray and no pydantic.
#
#   bash bench/gpu_bundle.sh            # -> .devbundle/cp312/site-cp312.tar.gz (Python 3.12)
#   PYV=3.11 bash bench/gpu_bundle.sh   # -> .devbundle/cp311/site-cp311.tar.gz (a dry run here)
#
# Only the folder .devbundle/cpXY travels (the `run` tool's carry); the wheels and the
# unpacked tree stay in .devbundle/wheels-cpXY and .devbundle/build-cpXY.
#
# What it holds: Ray (core only: no Java jars, no rllib/serve/llm/data/tune/train, no
# dashboard web UI; stalwart starts Ray with include_dashboard=False), pydantic with
# pydantic_core, annotated-types, typing-inspection, typing_extensions (pydantic needs
# >= 4.16), jsonschema with referencing, rpds-py and jsonschema-specifications (Ray core
# needs it). Everything else stalwart and Ray import at start-up (torch, numpy, pyyaml, rich,
# click, fsspec, prometheus-client, nvidia-ml-py, aiohttp, grpcio, protobuf, msgpack,
# filelock, packaging, requests, attrs, psutil) is expected on the target already. Versions
# are those of constraints.txt. Run it from the repository root, where pip reaches PyPI;
# .devbundle/ must be ignored (.git/info/exclude) so that only `carry` takes it along.
set -euo pipefail
PYV=${PYV:-3.12}
TAG=cp${PYV/./}
DIR=.devbundle
PLATFORMS="--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64"
PIP_TARGET_OPTS="--only-binary=:all: --python-version $PYV --implementation cp $PLATFORMS"
pin() { grep -i "^$1==" constraints.txt | head -1; }
PKGS=(ray pydantic pydantic_core annotated-types typing-inspection typing_extensions
      jsonschema referencing rpds-py jsonschema-specifications)
specs=()
for p in "${PKGS[@]}"; do
    spec=$(pin "$p")
    [ -n "$spec" ] || { echo "gpu_bundle: no pin for $p in constraints.txt" >&2; exit 1; }
    specs+=("$spec")
done
mkdir -p "$DIR/wheels-$TAG"
python3 -m pip download -q --no-deps $PIP_TARGET_OPTS -d "$DIR/wheels-$TAG" "${specs[@]}"
site="$DIR/build-$TAG"
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    $PIP_TARGET_OPTS "$DIR/wheels-$TAG"/*.whl
# Not imported by stalwart nor by Ray core at start-up (ray/__init__.py loads data,
# workflow and autoscaler lazily): the Java worker, the libraries and the web UI.
rm -rf "$site"/bin "$site"/ray/jars "$site"/ray/rllib "$site"/ray/serve "$site"/ray/llm \
    "$site"/ray/data "$site"/ray/tune "$site"/ray/train "$site"/ray/dashboard/client/build
find "$site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$DIR/$TAG"
tar -C "$site" -czf "$DIR/$TAG/site-$TAG.tar.gz" .
ls -l "$DIR/$TAG/site-$TAG.tar.gz"
du -sh "$site"

#!/usr/bin/env bash
# stalwart's checks on a lent GPU machine (one GPU, torch present, no network, no Ray), in
# one command that ends in under 7 minutes:
#
#   1. unpack the offline bundle that bench/gpu_bundle.sh built
#      (.devbundle/cpXY/site-cpXY.tar.gz: a slimmed Ray, pydantic, jsonschema and what they
#      need) into $STALWART_SITE (/tmp/site), byte-compile it (every Ray process imports it),
#      and put it and the checkout on PYTHONPATH: stalwart/__init__.py finds
#      orchestrator/, health/, ckpt/ beside itself in a checkout, so nothing is pip-installed;
#      a `stalwart` wrapper runs `python3 -m stalwart.orchestrator.cli`;
#   2. nvidia-smi's summary line and the versions found; on torch < 2.13 (the machine has
#      2.11) bench/torch_backport.py adds the two torch.distributed helpers of 2.13 that
#      stalwart's process group needs, in every Python process (a .pth file);
#   3. bench/gpu_check.py: sync against async snapshots under NCCL DDP, NVML readings, FSDP2
#      on stalwart's ElasticGroup with a subgroup abort and a restore (one GPU: one rank);
#   4. `stalwart run bench/gpu/job.yaml` on the embedded local Ray (1 rank, gpu: 1, backend
#      nccl, NVML probe; a one-rank job has no process group traffic, so NCCL itself is
#      exercised by step 3 only): failure-free, then the rank killed at step 120 and
#      recovered in a fresh process (the CUDA snapshot path, the CUDA RNG state, the GPU's
#      hand-over); both final model digests must be equal. Then, while time is left, a hang
#      (found by the hang detector, the rank replaced) and a kill in the middle of a
#      snapshot's device-to-host copy; their digests must be equal too.
#
# Each step runs under `timeout` and the script goes on after a failure; it exits 1 if any
# check failed (2 when the bundle could not be installed). Everything goes to $OUT:
# device.log (all output), gpu_check.json, summary.json (digests, verdicts), runs.tar.gz
# (each run's result.json, events.jsonl and rank logs; Ray's logs when a run failed).
#
# With the `run` tool:  bash bench/gpu_device_run.sh   (carry: [".devbundle/cp312"])
# On a machine without a GPU it runs a CPU variant (gloo, no GPU resource, a smaller model,
# a small gpu_check on CPU): a dry run of the script itself, e.g. with another Python and
# its bundle (PYV=3.11 bash bench/gpu_bundle.sh), and longer limits on a slow machine:
#   PY=/path/to/python3.11 OUT=/tmp/out RUN_TIMEOUT_S=400 BUDGET_S=9999 \
#       bash bench/gpu_device_run.sh
# Versions below stalwart's tested floor (torch 2.11 there) are let through by
# STALWART_ALLOW_UNTESTED_VERSIONS=1 (orchestrator/compat.py); the API checks still apply.
set -uo pipefail
export PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-/tmp/stalwart-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
PY=${PY:-python3}
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
BUNDLE=${STALWART_BUNDLE:-$REPO/.devbundle/$PYTAG/site-$PYTAG.tar.gz}
SITE=${STALWART_SITE:-/tmp/site}
RUNS=$REPO/runs/gpu-device
mkdir -p "$REPO/runs"
# Seconds since the start: nothing starts after DEADLINE_S - 45 and every step's timeout
# ends by DEADLINE_S (then 10-20 s of verdicts and packing), so the whole script ends within
# about DEADLINE_S + 35 s (380: under 7 minutes).
DEADLINE_S=${DEADLINE_S:-380}
BUDGET_S=${BUDGET_S:-300}  # the optional runs (hang, kill during a snapshot) start before this
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}  # one `stalwart run`, Ray's start included
RETRY_BEFORE_S=${RETRY_BEFORE_S:-300}  # a run whose Ray did not start is retried before this
FAILED=()

say() { printf '\n=== [%3ds] %s\n' "$SECONDS" "$*"; }
limit() {  # limit WANT: WANT seconds, or what is left before DEADLINE_S if that is less
    local left=$((DEADLINE_S - SECONDS))
    echo $((left < $1 ? left : $1))
}
check() {  # check NAME RC: record a verdict
    if [ "$2" -eq 0 ]; then echo "CHECK $1: PASS"; else echo "CHECK $1: FAIL (rc=$2)"; FAILED+=("$1"); fi
}

say "bundle $BUNDLE -> $SITE"
if [ ! -f "$BUNDLE" ]; then
    echo "no bundle at $BUNDLE: build it with bench/gpu_bundle.sh, carry .devbundle/$PYTAG"
    exit 2
fi
mkdir -p "$SITE/bin" && tar -xzf "$BUNDLE" -C "$SITE" || exit 2
# Compiled once here rather than by every Ray process that starts at once (agents, workers).
timeout 120 "$PY" -m compileall -q -j 0 "$SITE" "$REPO/orchestrator" "$REPO/health" \
    "$REPO/ckpt" "$REPO/stalwart" "$REPO/examples" >/dev/null || echo "compileall: rc $?"
printf '#!/bin/sh\nexec %s -m stalwart.orchestrator.cli "$@"\n' "$(command -v "$PY")" \
    >"$SITE/bin/stalwart" && chmod +x "$SITE/bin/stalwart"
export PATH="$SITE/bin:$PATH"
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export STALWART_ALLOW_UNTESTED_VERSIONS=1
# torch < 2.13 lacks two torch.distributed helpers stalwart's process group needs (compat.py
# refuses it): bench/torch_backport.py gives them to every Python process here through a .pth
# file in the interpreter's site-packages. STALWART_TORCH_BACKPORT=0 runs without it.
export STALWART_TORCH_BACKPORT=${STALWART_TORCH_BACKPORT:-1}
cp bench/torch_backport.py "$SITE/stalwart_torch_backport.py"
PURELIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PTH="$PURELIB/stalwart_torch_backport.pth"
if printf '%s\n' 'import sys; exec("try:\n import stalwart_torch_backport\nexcept ImportError:\n pass")' \
    >"$PTH"; then
    trap 'rm -f "$PTH"' EXIT  # inert without the variable, but not left behind
else  # a read-only site-packages: a sitecustomize on PYTHONPATH instead
    echo "cannot write $PTH: the backport loads from $SITE/sitecustomize.py"
    echo "import stalwart_torch_backport" >"$SITE/sitecustomize.py"
fi
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS (docs/exactness.md)
export RAY_USAGE_STATS_ENABLED=0        # no network: do not try to report
du -sh "$SITE" | cat

say "machine"
if nvidia-smi -L >/dev/null 2>&1; then
    GPU=1
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,temperature.gpu,power.draw,clocks.sm --format=csv,noheader
else
    GPU=0
    echo "no GPU (nvidia-smi failed): the CPU variant (gloo, resources.gpu=0) runs"
fi
echo "cpus $(nproc); $(df -h /dev/shm | tail -1)"
timeout 120 "$PY" - <<'EOF'
import platform, sys, warnings
warnings.simplefilter("always")
import torch, ray, pydantic, jsonschema, pynvml
import stalwart
from stalwart.orchestrator import compat
compat.require_ray()
compat.require_torch()
import stalwart.orchestrator.worker.collective  # the private torch APIs, at import
import stalwart_torch_backport
print(f"torch backport: {stalwart_torch_backport.applied or 'not needed'}")
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print(f"python {platform.python_version()} torch {torch.__version__} cuda {torch.version.cuda} "
      f"nccl {nccl} gpus {torch.cuda.device_count()} ray {ray.__version__} "
      f"pydantic {pydantic.__version__} stalwart {stalwart.__version__} from {stalwart.__file__}")
EOF
check imports $?
timeout 60 stalwart --help >/dev/null
check stalwart-cli $?

say "bench/gpu_check.py"
if [ "$GPU" = 1 ]; then
    timeout -k 10 "$(limit 180)" "$PY" bench/gpu_check.py --state-gb 1 --steps 10 \
        --out "$OUT/gpu_check.json" >"$RUNS.gpu_check.stdout"
else
    timeout -k 10 "$(limit 200)" "$PY" bench/gpu_check.py --device cpu --ranks 1 --state-gb 0.002 \
        --width 256 --batch 64 --steps 4 --out "$OUT/gpu_check.json" >"$RUNS.gpu_check.stdout"
fi
check gpu_check $?
if [ "${ONLY_GPU_CHECK:-0}" = 1 ]; then  # a rerun of bench/gpu_check.py alone
    [ ${#FAILED[@]} -eq 0 ] && { echo "GPU CHECK: PASS (${SECONDS}s)"; exit 0; }
    echo "GPU CHECK: FAIL: ${FAILED[*]} (${SECONDS}s)"; exit 1
fi

# The GPU job, or its CPU variant; each run in its own directory under $RUNS.
JOB=bench/gpu/job.yaml
SETS=()
# CPU variant: gloo, no GPU resource, a smaller model (a dry run, not a measurement)
[ "$GPU" = 1 ] || SETS=(--set resources.gpu=0 --set backend=gloo
    --set config.model.d_model=64 --set config.model.n_layers=2)
rm -rf "$RUNS" && mkdir -p "$RUNS"
ATTEMPTED=()
run_job() {  # run_job NAME FAULTS_YAML
    local name=$1 faults=$2
    local try rc
    for try in 1 2; do
        if [ "$(limit 9999)" -lt 45 ]; then
            echo "no time left for the $name run (${SECONDS}s gone)"
            return
        fi
        [ "$try" = 1 ] && ATTEMPTED+=("$name")
        say "stalwart run $JOB: $name ${faults} (try $try)"
        timeout -k 20 "$(limit "$RUN_TIMEOUT_S")" stalwart run "$JOB" "${SETS[@]}" \
            --set "chaos.faults=$faults" --run-dir "$RUNS/$name" </dev/null
        rc=$?
        echo "stalwart run ($name) exited $rc"
        [ $rc -eq 0 ] || RAY_LOGS=1
        # Once more only if it never started (no run directory: Ray's start failed) and
        # there is time left for it.
        [ ! -d "$RUNS/$name" ] && [ "$SECONDS" -lt "$RETRY_BEFORE_S" ] || break
    done
}
RAY_LOGS=0
run_job baseline '[]'
run_job kill '[{kind: kill_worker, rank: 0, at_step: 120}]'
if [ "$SECONDS" -lt "$BUDGET_S" ]; then
    run_job hang '[{kind: hang, rank: 0, at_step: 80}]'
else
    echo "skipped the hang run: ${SECONDS}s gone"
fi
if [ "$SECONDS" -lt "$BUDGET_S" ]; then
    run_job kill-snapshot '[{kind: kill_worker, rank: 0, at_step: 50, during: snapshot}]'
else
    echo "skipped the kill-during-snapshot run: ${SECONDS}s gone"
fi

say "verdicts"
timeout 60 "$PY" - "$RUNS" "$OUT/summary.json" "${ATTEMPTED[@]}" <<'EOF'
import json, sys
from pathlib import Path

runs, out, attempted = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
def load(name):
    try:
        return json.loads((runs / name / "result.json").read_text())
    except (OSError, ValueError):
        return None
base = load("baseline")
summary, ok = {"runs": {}}, True
want = base.get("model_digest") if base else None
for name in dict.fromkeys(["baseline", "kill", *attempted]):  # these two are required
    r = load(name)
    if r is None:
        print(f"{name:14} no result.json: FAIL")
        summary["runs"][name] = {"verdict": "FAIL", "why": ["no result.json"]}
        ok = False
        continue
    failures = r.get("failures") or []
    row = {
        "status": r.get("status"),
        "steps_completed": r.get("steps_completed"),
        "model_digest": r.get("model_digest"),
        "final_loss": r.get("final_loss"),
        "restarts": r.get("restarts"),
        "failures": [
            {k: f.get(k) for k in ("kind", "rank", "step", "injected", "message",
                                   "detected_after_s", "restored_step", "steps_redone",
                                   "recovered_after_s")}
            for f in failures
        ],
        "wall_seconds": r.get("wall_seconds"),
        "steps_per_second": r.get("steps_per_second"),
        "workers": r.get("workers"),
    }
    why = []
    if r.get("status") != "succeeded":
        why.append(f"status {r.get('status')}")
    if not r.get("model_digest"):
        why.append("no model digest")
    elif name != "baseline" and r["model_digest"] != want:
        why.append("digest differs from the failure-free run's")
    if name != "baseline" and not any(f.get("injected") for f in failures):
        why.append("no injected failure was recorded: the fault did not fire")
    row["verdict"] = "FAIL" if why else "PASS"
    row["why"] = why
    summary["runs"][name] = row
    ok = ok and not why
    print(f"{name:14} {row['status']!s:10} digest {row['model_digest']} "
          f"failures {len(failures)} {row['verdict']}{': ' + '; '.join(why) if why else ''}")
summary["verdict"] = "PASS" if ok else "FAIL"
out.write_text(json.dumps(summary, indent=2) + "\n")
print(f"digest baseline: {want}")
print(f"digest kill:     {(load('kill') or {}).get('model_digest')}")
print("RECOVERY PASS: every recovered run ends with the failure-free model" if ok
      else "RECOVERY FAIL: see the lines above")
sys.exit(0 if ok else 1)
EOF
check recovery $?

say "collect"
extra=()
if [ "$RAY_LOGS" = 1 ] && [ -d /tmp/ray/session_latest/logs ]; then
    # the newest session's logs, the small ones: why a run failed
    find -L /tmp/ray/session_latest/logs -maxdepth 1 -type f -size -2M \
        \( -name '*.err' -o -name '*.out' -o -name '*.log' \) >"$RUNS.raylogs" 2>/dev/null
    extra=(-T "$RUNS.raylogs")
fi
tar -czf "$OUT/runs.tar.gz" -C "$REPO/runs" gpu-device gpu-device.gpu_check.stdout "${extra[@]}" \
    2>/dev/null
ls -la "$OUT"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "GPU DEVICE RUN: PASS (${SECONDS}s)"
    exit 0
fi
echo "GPU DEVICE RUN: FAIL: ${FAILED[*]} (${SECONDS}s)"
exit 1

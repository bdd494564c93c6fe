#!/usr/bin/env bash
# The GPU checks of this repository in one command, for a session that is lent a GPU machine (the device tool's
# `run`; see the device tool's README). That machine has torch, lightning, pytest and accelerate but no
# internet, and lacks deepspeed, torchao and pydantic/hjson (deepspeed's needs): they travel as wheels in .whl/.
#
# 1. Here, where pip reaches the package registries, once per checkout (builds .whl/, ~9 MiB, git-ignored):
#        PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh prepare
# 2. On the device, as one call:
#        run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# Steps, each under `timeout` and inside a 9-minute overall deadline, continuing after a failure:
#   - the precision benchmark (benchmarks/precision_throughput.py, ~152M GPT; its JSON is rewritten after every
#     variant, so a cut-short run still reports what it measured),
#   - the GPU tests (pytest -m gpu),
#   - any other GPU benchmark present (benchmarks/*_gpu.py), each under torchrun with one process per GPU.
# Files in $OUT (7, within the tool's limit of 8): env.txt, precision_throughput.json, precision_throughput.log,
# gpu_tests.log, gpu_tests.xml, other_benchmarks.log, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(torchao==0.18.0 hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions lightning==2.6.6)

prepare() {
  # torchao 0.18 is the release built for torch 2.11, the device's torch; deepspeed ships as an sdist: built here.
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  rm -rf .whl && mkdir -p .whl
  local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${WHEELS[@]}" || return 1
  # pydantic pins pydantic-core exactly: fetch the pinned one instead of the newest.
  local core
  core=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
  rm -f .whl/pydantic_core-*.whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "pydantic-core==$core" || return 1
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8 || return 1
  du -sh .whl && ls .whl
}

if [[ "${1:-}" == "prepare" ]]; then
  prepare
  exit $?
fi

OUT=${OUT:-$PWD/gpu_session_out}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + 540 ))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8

# Seconds a step may take: its own budget, or what is left before the deadline (minus a margin for the summary).
budget() {
  local left=$(( DEADLINE - $(date +%s) - 15 ))
  (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"
}

step() {  # step NAME BUDGET LOG COMMAND...: run with a timeout, record the exit status, never stop the script
  local name=$1 limit log=$3
  limit=$(budget "$2")
  shift 3
  echo "== $name (timeout ${limit}s)" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')" | tee -a "$OUT/summary.txt"
}

if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ carried: deepspeed and torchao tests will be skipped" | tee -a "$OUT/summary.txt"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__)"
  for pkg in deepspeed torchao; do "$PY" -c "import $pkg; print('$pkg', $pkg.__version__)" 2>&1 | tail -1; done
} > "$OUT/env.txt" 2>&1

# PRECISION_ARGS adds benchmark options, e.g. "--size small --steps 3" for a dry run of this script on a CPU.
# shellcheck disable=SC2086
step precision_benchmark 240 "$OUT/precision_throughput.log" \
  "$PY" benchmarks/precision_throughput.py --out "$OUT/precision_throughput.json" ${PRECISION_ARGS:-}
step gpu_tests 240 "$OUT/gpu_tests.log" \
  "$PY" -m pytest -m gpu tests -q -rs -p no:cacheprovider --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml"
: > "$OUT/other_benchmarks.log"
for bench in benchmarks/*_gpu.py; do
  [[ -e "$bench" ]] || continue
  step "$(basename "$bench" .py)" 120 "$OUT/other_benchmarks.log" \
    "$PY" -m torch.distributed.run --nproc_per_node=gpu --master_addr=127.0.0.1 --master_port=29511 "$bench"
done

{
  echo "--- precision benchmark"
  sed -n '/^variant /,$p' "$OUT/precision_throughput.log"
  echo "--- GPU tests"
  tail -n 15 "$OUT/gpu_tests.log"
} >> "$OUT/summary.txt"
cat "$OUT/env.txt" "$OUT/summary.txt"

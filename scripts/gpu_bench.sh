#!/usr/bin/env bash
# fedbench's speed on a GPU in one call (issue 36; docs/gpu.md): the engine against a
# hand-written loop and the arithmetic floor, 500 clients in a round, a DiversiFed Table I
# column, and the per-algorithm benchmark where it exists. Needs nothing from outside: run
# scripts/gpu_wheels.sh where pip has network first, and carry .whl and
# .gpu-data/fashion-mnist to the GPU machine.
#
#   scripts/gpu_bench.sh OUTDIR                              # on a GPU machine (device cuda)
#   GPU_BENCH_DEVICE=cpu GPU_BENCH_SMOKE=1 scripts/gpu_bench.sh OUT   # test the script here
#
# OUTDIR gets tables.md (every table), engine.json, column.json, bench.log and, where
# the per-algorithm benchmark (bench_algorithms.py beside this script) exists, algorithms/
# (its tables). Parts and their hard time
# limits in seconds (environment):
#   GPU_BENCH_ENGINE_S (150)  scripts/bench_engine.py: cases (a) FMNIST MLP round, (b) FedAvg
#       CNN, (c) ResNet-8 GroupNorm, (cbn) ResNet-8 BatchNorm, (d50, d) 50 and 500 small
#       clients; each on the sequential and vmap backends and a minimal hand-written loop,
#       beside the arithmetic floor (FLOPs / the device's measured float32 matmul rate),
#       with peak GPU memory (n/a on the CPU); GPU_BENCH_REPS timed rounds (3); the cases
#       in GPU_BENCH_CASES (all six)
#   GPU_BENCH_COLUMN_S (150)  scripts/bench_column.py: DiversiFed Table I's FMNIST column, 12
#       methods (GPU_BENCH_METHODS), seed 0, each for an equal share of the time, extrapolated
#       to 500 rounds and marked so
#   GPU_BENCH_ALGOS_S (90)    bench_algorithms.py --device DEVICE, if that script exists
#       (arguments: GPU_BENCH_ALGOS_ARGS, default "--settings mlp --rounds 2")
# GPU_BENCH_SMOKE=1: tiny cases and a small federation, to test the script on a CPU; the
# numbers then mean nothing. Exit status: 0 every part finished; 1 a part failed or ran out
# of time (bench.log says which); 2 the script could not start.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"  # ROOT, PY, die, gpu_env, need_device

[[ $# -eq 1 ]] || die "usage: $0 OUTDIR"
OUTDIR="$1"
DEVICE="${GPU_BENCH_DEVICE:-cuda}"
SMOKE="${GPU_BENCH_SMOKE:-0}"
ENGINE_S="${GPU_BENCH_ENGINE_S:-150}"
COLUMN_S="${GPU_BENCH_COLUMN_S:-150}"
ALGOS_S="${GPU_BENCH_ALGOS_S:-90}"
REPS="${GPU_BENCH_REPS:-3}"
CASES="${GPU_BENCH_CASES:-a,b,c,cbn,d50,d}"
METHODS="${GPU_BENCH_METHODS:-fedavg local perfedavg pfedme fedamp fedfomo apple fedrep fedproto fedrod fedcac diversifed}"
ALGOS_ARGS="${GPU_BENCH_ALGOS_ARGS:---settings mlp --rounds 2}"
mkdir -p "$OUTDIR" || die "cannot create $OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$ROOT"
exec > >(tee "$OUTDIR/bench.log") 2>&1
t_start=$(date +%s)
gpu_env
need_device "$DEVICE"
[[ "$DEVICE" == cpu ]] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null || true

ENGINE_ARGS=(--device "$DEVICE" --cases "$CASES" --reps "$REPS"
  --budget "$((ENGINE_S / 20 + 1))" --json "$OUTDIR/engine.json" --md "$OUTDIR/engine.md")
COLUMN_EXTRA=()
if [[ "$SMOKE" == 1 ]]; then
  ENGINE_ARGS+=(--quick)
  COLUMN_EXTRA=(--extra clients=4 local_epochs=1 split.train_per_client=60)
  ALGOS_ARGS="--quick $ALGOS_ARGS"
fi
[[ "$DEVICE" == cpu ]] && ENGINE_ARGS+=(--no-rss)  # peak memory: n/a on the CPU
read -r -a methods <<<"$METHODS"
per_method=$((COLUMN_S / ${#methods[@]}))
((per_method >= 5)) || die "GPU_BENCH_COLUMN_S=$COLUMN_S leaves under 5 s per method"

failed=()
part() {  # part NAME SECONDS CMD...: run CMD under a hard limit; note a failure or timeout
  local name=$1 limit=$2 rc=0
  shift 2
  echo "== $name, at most $limit s: $*"
  timeout -k 10 "$limit" "$@" || rc=$?
  case $rc in
    0) ;;
    124 | 137) failed+=("$name (stopped at its $limit s limit)") ;;
    *) failed+=("$name (exit $rc)") ;;
  esac
}

part engine "$ENGINE_S" "$PY" scripts/bench_engine.py "${ENGINE_ARGS[@]}"
# the column's own limit per method, plus the grace a round under way gets to finish
part column "$((COLUMN_S + per_method + 30))" "$PY" scripts/bench_column.py --device "$DEVICE" \
  --methods "$METHODS" --seconds "$per_method" --json "$OUTDIR/column.json" \
  --md "$OUTDIR/column.md" "${COLUMN_EXTRA[@]}"
ALGOS_PY="$ROOT/scripts/bench_algorithms.py"  # another issue's script: run where present
if [[ -f "$ALGOS_PY" ]]; then
  read -r -a algos_args <<<"$ALGOS_ARGS"
  part algorithms "$ALGOS_S" "$PY" "$ALGOS_PY" --device "$DEVICE" \
    --out "$OUTDIR/algorithms" "${algos_args[@]}"
else
  echo "== algorithms: $ALGOS_PY not in this checkout, skipped"
fi

{
  echo "# gpu_bench: $("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'), device $DEVICE$([[ $SMOKE == 1 ]] && echo ' (SMOKE: tiny cases, numbers meaningless)')"
  echo
  echo "$("$PY" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)'), $(date '+%Y-%m-%d %H:%M:%S')"
  for f in engine.md column.md algorithms/algorithms.md; do
    [[ $f == algorithms/* && ! -f "$ALGOS_PY" ]] && continue  # not in this checkout
    echo
    if [[ -f "$OUTDIR/$f" ]]; then cat "$OUTDIR/$f"; else echo "($f: not written)"; fi
  done
  if ((${#failed[@]})); then
    echo
    printf 'FAILED: %s\n' "${failed[@]}"
  fi
} >"$OUTDIR/tables.md"
rm -f "$OUTDIR/engine.md" "$OUTDIR/column.md"  # in tables.md (at most 8 files come back)
echo "== $(($(date +%s) - t_start)) s in all; tables: $OUTDIR/tables.md"
cat "$OUTDIR/tables.md"
if ((${#failed[@]})); then
  printf 'gpu_bench.sh: %s\n' "${failed[@]}" >&2
  exit 1
fi

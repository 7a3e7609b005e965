#!/usr/bin/env bash
# fedbench on a GPU: the quick tests with the device set to CUDA, then every algorithm against
# the CPU's numbers, device=auto, resuming across devices, evaluation memory and vmap chunking
# (issue 35; docs/gpu.md). Needs nothing from outside: run scripts/gpu_wheels.sh where pip has
# network first, and carry .whl and .gpu-data/fashion-mnist to the GPU machine.
#
#   scripts/gpu_check.sh OUTDIR                     # on a GPU machine (device cuda)
#   GPU_CHECK_DEVICE=cpu scripts/gpu_check.sh OUT   # the same on the CPU (to test the script)
#
# OUTDIR gets report.md and report.json (scripts/gpu_check.py), tests.log and tests.xml (the
# quick tests), check.log. Hard time limits (seconds, environment): GPU_CHECK_TESTS_S (150,
# the tests) and GPU_CHECK_RUNS_S (170, gpu_check.py): under 6 minutes in all, so that a
# second try fits a 15-minute GPU lease. GPU_CHECK_WORKERS: pytest workers (8);
# GPU_CHECK_RUN_WORKERS: gpu_check.py's processes (cuda 6, cpu 1). GPU_CHECK_PYTEST_ARGS: what
# pytest collects (default: tests, the whole quick suite; e.g. a few files to test the script).
# Exit status: 0 every check passed; 1 a check failed or ran out of time (the report says
# which); 2 the script could not start (usage, packages, data, no GPU).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_env.sh"  # ROOT, PY, die, gpu_env, need_device

[[ $# -eq 1 ]] || die "usage: $0 OUTDIR"
OUTDIR="$1"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
TESTS_S="${GPU_CHECK_TESTS_S:-150}"
RUNS_S="${GPU_CHECK_RUNS_S:-170}"
WORKERS="${GPU_CHECK_WORKERS:-8}"
PYTEST_ARGS="${GPU_CHECK_PYTEST_ARGS:-tests}"
RUN_WORKERS="${GPU_CHECK_RUN_WORKERS:-}"  # gpu_check.py's processes (default: cuda 6, cpu 1)
mkdir -p "$OUTDIR" || die "cannot create $OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$ROOT"
t_start=$(date +%s)
gpu_env
need_device "$DEVICE"
[[ "$DEVICE" == cpu ]] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

echo "== quick tests ($PYTEST_ARGS), FEDBENCH_TEST_DEVICE=$DEVICE, at most ${TESTS_S} s"
read -r -a pytest_args <<<"$PYTEST_ARGS"
t0=$(date +%s)
set +e
FEDBENCH_TEST_DEVICE="$DEVICE" timeout -k 10 "$TESTS_S" "$PY" -m pytest -m quick -v -n "$WORKERS" \
  -p no:cacheprovider --junitxml "$OUTDIR/tests.xml" "${pytest_args[@]}" >"$OUTDIR/tests.log" 2>&1
tests_rc=$?
set -e
tests_s=$(($(date +%s) - t0))
tail -n 3 "$OUTDIR/tests.log"
case $tests_rc in
  0) tests_status=pass ;;
  124 | 137) tests_status=fail; echo "quick tests: stopped at the ${TESTS_S} s limit" >>"$OUTDIR/tests.log" ;;
  *) tests_status=fail ;;
esac

echo "== gpu_check.py --device $DEVICE, at most ${RUNS_S} s"
set +e
timeout -k 10 "$RUNS_S" "$PY" scripts/gpu_check.py --device "$DEVICE" --out "$OUTDIR" \
  --budget "$((RUNS_S - 40))" ${RUN_WORKERS:+--workers "$RUN_WORKERS"} \
  --tests "$tests_status" "$tests_rc" "$tests_s" "$OUTDIR/tests.xml" "$OUTDIR/tests.log" \
  2>&1 | tee "$OUTDIR/check.log"
check_rc=${PIPESTATUS[0]}
set -e
case $check_rc in
  0 | 1) ;;
  124 | 137) echo "gpu_check.py: stopped at the ${RUNS_S} s limit; report.md holds the checks that finished" | tee -a "$OUTDIR/check.log" ;;
  *) echo "gpu_check.py exited with $check_rc (see check.log)" ;;
esac
echo "== $(($(date +%s) - t_start)) s in all; report: $OUTDIR/report.md"
[[ -f "$OUTDIR/report.md" ]] && sed -n '1,20p' "$OUTDIR/report.md"
if [[ $tests_rc -eq 0 && $check_rc -eq 0 ]]; then exit 0; fi
exit 1

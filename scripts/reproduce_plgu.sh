#!/usr/bin/env bash
# Reproduce PLGU's Tables 1-4 and Fig. 5 (Qu et al., CVPR 2023; docs/papers/plgu.md): one
# Hydra multirun per table column and method, over the seeds, then the report.
#
#   scripts/reproduce_plgu.sh                       # every table
#   scripts/reproduce_plgu.sh t1                    # Table 1, its five columns
#   scripts/reproduce_plgu.sh t1_cifar10            # one column (a preset without "plgu_")
#   SEEDS=0 ROUNDS=50 scripts/reproduce_plgu.sh t1_cifar10   # a quick look
#   DRY_RUN=1 scripts/reproduce_plgu.sh t3          # print the commands only
#
# Tables 1 and 2 print the global and the personalized models of the same runs: a column
# and method run for one of them is not run again for the other (one sweep directory,
# $OUT/t1_t2/<column>/<method>; the sweeps of Tables 3-4 and Fig. 5 go to $OUT/<preset>).
# Tables 3-4 and Fig. 5 sweep E, rho and D on CIFAR-10 with C = 10.
# The script only sweeps: a method's PLGU settings (FedRep's head epochs, the hypernetwork of
# pFedHN / PLGU-GHN, E epochs of local work for every method) are config
# (conf/paper_algo/plgu/<algo>.yaml, chosen by the preset), so one cell of a table is
# `fedbench +experiment=plgu_<preset> algo=<method>`.
#
# Environment: SEEDS (comma list, default 0,1,2: the paper does not say how many runs),
# ROUNDS (default: the presets' 500), METHODS (space list, default: the table's rows),
# OUT (sweep root, default multirun/plgu), EXTRA (more overrides for every run, e.g.
# "device=cuda" or "data.root=/data hydra/launcher=joblib_local").
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"  # ROOT, EXTRA_ARGS, run, sweep, run_sweeps, finish
SEEDS="${SEEDS:-0,1,2}"
OUT="${OUT:-multirun/plgu}"

COLUMNS="cifar10 cifar10_c100 cifar100 cifar100_c100 tinyimagenet"
declare -A METHODS_OF=(
  [t1]="fedavg fedsam ditto pfedme plgu_lf"
  [t2]="ditto pfedme fedrep pfedhn plgu_lf plgu_grep plgu_ghn"
  [t3]="plgu_lf plgu_grep plgu_ghn"
  [t4]="plgu_lf plgu_grep plgu_ghn"
  [f5]="plgu_lf"
)
declare -A SWEEP_OF=(
  [t1]="" [t2]=""
  [t3]="local_epochs=1,5,10"
  [t4]="algo.rho=0.05,0.1,0.5"
  [f5]="algo.personal_layers=0,1,5,10,23"
)

# The presets (without "plgu_") asked for, in order.
presets=()
for arg in "${@:-all}"; do
  case "$arg" in
    all)
      for t in t1 t2; do for c in $COLUMNS; do presets+=("${t}_$c"); done; done
      presets+=(t3_cifar10 t4_cifar10 f5_cifar10) ;;
    t1 | t2) for c in $COLUMNS; do presets+=("${arg}_$c"); done ;;
    t3 | t4 | f5) presets+=("${arg}_cifar10") ;;
    *)
      [[ -f "$ROOT/conf/experiment/plgu_$arg.yaml" && $arg != common ]] || {
        echo "unknown table $arg; valid: all t1 t2 t3 t4 f5, or a preset such as t1_cifar10" >&2
        exit 2
      }
      presets+=("$arg") ;;
  esac
done

declare -A done_runs=()
for preset in "${presets[@]}"; do
  table=${preset%%_*}
  column=${preset#*_}
  # Tables 1 and 2 share their runs: one sweep directory per column and method.
  [[ $table == t1 || $table == t2 ]] && dir="$OUT/t1_t2/$column" || dir="$OUT/$preset"
  for method in ${METHODS:-${METHODS_OF[$table]}}; do
    [[ -z "${done_runs[$dir/$method]:-}" ]] || continue
    done_runs[$dir/$method]=1
    args=("+experiment=plgu_$preset" "algo=$method" "seed=$SEEDS")
    [[ -n "${SWEEP_OF[$table]}" ]] && args+=(${SWEEP_OF[$table]})
    [[ -n "${ROUNDS:-}" ]] && args+=("rounds=$ROUNDS")
    args+=("hydra.sweep.dir=$dir/$method" "${EXTRA_ARGS[@]}")
    sweep "${args[@]}"
  done
done

run_sweeps "PLGU ${presets[*]}"

# The tables: Tables 1-2 in the paper's layout beside its numbers; the sweeps as plain
# tables of avg with bottom 5% / top 5% beneath (PLGU-LF's global model too).
STATS="L.avg,L.bottom5,L.top5"
tables=$(printf '%s\n' "${presets[@]}" | sed 's/_.*//' | sort -u)
for t in $tables; do
  case "$t" in
    t1) run fedbench-report "$OUT/t1_t2" --preset plgu_table1 --compact ;;
    t2) run fedbench-report "$OUT/t1_t2" --preset plgu_table2 --compact ;;
    *)
      key=${SWEEP_OF[$t]%%=*}
      run fedbench-report "$OUT/${t}_cifar10" --rows algo --cols "$key" \
        --metric "${STATS//L./personal.L.}"
      run fedbench-report "$OUT/${t}_cifar10" --rows algo --cols "$key" \
        --metric "${STATS//L./global.L.}" --filter algo=plgu_lf ;;
  esac
done
finish

#!/usr/bin/env bash
# Reproduce FedSLR's Tables 1-2 (Huang et al. 2023, arXiv:2302.11051; docs/papers/fedslr.md):
# one Hydra multirun per column and method, over the seeds, then the report. Table 2 (model
# size, communication) is read from the Table 1 runs of the Dir(0.1) columns: nothing is run
# twice. The script only sweeps (column x method x seed): each method's FedSLR settings come
# with the preset (`paper: fedslr`, conf/paper_algo/fedslr/<algo>.yaml), so one cell is
#   fedbench +experiment=fedslr_t1_cifar10_dir algo=ditto seed=0
#
#   scripts/reproduce_fedslr.sh                         # Table 1 (all six columns) and Table 2
#   scripts/reproduce_fedslr.sh t1                      # the same
#   scripts/reproduce_fedslr.sh t2                      # the Dir(0.1) columns only, then Table 2
#   scripts/reproduce_fedslr.sh t1_cifar100_dir         # one column (a preset without "fedslr_")
#   SEEDS=0 ROUNDS=50 scripts/reproduce_fedslr.sh t1_cifar10_dir   # a quick look
#   DRY_RUN=1 scripts/reproduce_fedslr.sh               # print the commands only
#
# Environment: SEEDS (comma list, default 0: the paper does not say how many runs), ROUNDS
# (default: the presets' 1000), METHODS (space list, default: the table's rows that are
# registered), OUT (sweep root, default multirun/fedslr), EXTRA (more overrides for every
# run, e.g. "device=cuda" or "data.root=/data hydra/launcher=joblib_local").
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"  # ROOT, EXTRA_ARGS, run, sweep, run_sweeps, finish
SEEDS="${SEEDS:-0}"
OUT="${OUT:-multirun/fedslr}"

DATA="cifar10 cifar100 tinyimagenet"
# Table 1's rows (FedSLR is one run for its GKR and mixed rows; APFL when registered)
ALL_METHODS="scaffold feddyn fedavg fedslr perfedavg lg_fedavg fedrep ditto apfl local fedspa"

registered() {  # the methods with a conf/algo/<name>.yaml
  for m in $1; do
    if [[ -f "$ROOT/conf/algo/$m.yaml" ]]; then echo "$m"; else echo "skip $m: not registered" >&2; fi
  done
}

columns=()
reports=()
for arg in "${@:-t1}"; do
  case "$arg" in
    t1) for d in $DATA; do columns+=("t1_${d}_iid" "t1_${d}_dir"); done; reports+=(t1 t2) ;;
    t2) for d in $DATA; do columns+=("t1_${d}_dir"); done; reports+=(t2) ;;
    *)
      [[ -f "$ROOT/conf/experiment/fedslr_$arg.yaml" && $arg == t1_* ]] || {
        echo "unknown table $arg; valid: t1 t2, or a column such as t1_cifar100_dir" >&2
        exit 2
      }
      columns+=("$arg")
      reports+=(t1) ;;
  esac
done

declare -A done_runs=()
for column in "${columns[@]}"; do
  dir="$OUT/$column"
  for method in $(registered "${METHODS:-$ALL_METHODS}"); do
    [[ -z "${done_runs[$dir/$method]:-}" ]] || continue
    done_runs[$dir/$method]=1
    args=("+experiment=fedslr_$column" "algo=$method" "seed=$SEEDS")
    [[ -n "${ROUNDS:-}" ]] && args+=("rounds=$ROUNDS")
    args+=("hydra.sweep.dir=$dir/$method" "${EXTRA_ARGS[@]}")
    sweep "${args[@]}"
  done
done

run_sweeps "FedSLR ${columns[*]}"

for t in $(printf '%s\n' "${reports[@]}" | sort -u); do
  case "$t" in
    t1) run fedbench-report "$OUT" --preset fedslr_table1 --compact ;;
    t2) run fedbench-report "$OUT" --preset fedslr_table2 --compact ;;
  esac
done
finish

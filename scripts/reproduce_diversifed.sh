#!/usr/bin/env bash
# Reproduce DiversiFed's Tables I, II, III and VII (docs/papers/diversifed.md): one Hydra
# multirun per table column and method, over the seeds, then the report in the paper's
# layout beside the paper's numbers.
#
#   scripts/reproduce_diversifed.sh                    # every table
#   scripts/reproduce_diversifed.sh table1_fmnist      # one column group (a preset name
#                                                      # without "diversifed_"), or table1 ...
#   SEEDS=0 ROUNDS=50 scripts/reproduce_diversifed.sh table1_fmnist   # a quick look
#   DRY_RUN=1 scripts/reproduce_diversifed.sh table2   # print the commands only
#
# Environment: SEEDS (comma list, default 0,1,2,3,4: the paper's 5 runs), ROUNDS (default:
# the preset's 500), METHODS (space list, default: the table's rows), OUT (sweep root,
# default multirun/diversifed), EXTRA (more overrides for every run, e.g.
# "hydra/launcher=joblib_local hydra.launcher.n_jobs=8" or "device=cuda"), COLUMN (the
# columns of Tables II and VII to run instead of all, e.g. COLUMN=split.alpha=0.1).
# Methods whose conf/algo/<name>.yaml does not exist yet are skipped with a note.
# The script only sweeps: a method's DiversiFed settings (pFedMe's eval_model=local, FedCAC's
# CIFAR-100 tau/beta ...) are config (conf/paper_algo/diversifed*/<algo>.yaml, chosen by the
# preset), so one cell of a table is `fedbench +experiment=diversifed_<preset> algo=<method>`.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"  # ROOT, EXTRA_ARGS, run, sweep, run_sweeps, finish
SEEDS="${SEEDS:-0,1,2,3,4}"
OUT="${OUT:-multirun/diversifed}"

ALL_METHODS="fedavg local perfedavg pfedme fedamp fedfomo apple fedrep fedproto fedrod fedcac diversifed"
T7_METHODS="fedavg perfedavg pfedme fedamp fedfomo apple diversifed"

# preset -> the sweep over its columns
declare -A COLUMNS=(
  [table1_fmnist]="" [table1_cifar10]="" [table1_cifar100]=""
  [table2_fmnist]="split.alpha=0.1,0.5,1.0"
  [table2_cifar10]="split.alpha=0.1,0.5,1.0"
  [table2_cifar100]="split.alpha=0.01,0.1,0.5"
  [table3_pathmnist]=""
  [table7_cifar10]="participation=1.0,0.9,0.7,0.5"
)
ORDER="table1_fmnist table1_cifar10 table1_cifar100 table2_fmnist table2_cifar10
table2_cifar100 table3_pathmnist table7_cifar10"

presets=()
for arg in "${@:-all}"; do
  case "$arg" in
    all) read -r -a presets <<< "$(echo $ORDER)" ;;
    table1 | table2 | table3 | table7)
      for p in $ORDER; do [[ $p == "$arg"_* ]] && presets+=("$p"); done ;;
    *)
      [[ -v "COLUMNS[$arg]" ]] || {
        echo "unknown table $arg; valid: all table1 table2 table3 table7 $(echo $ORDER)" >&2
        exit 2
      }
      presets+=("$arg") ;;
  esac
done

for preset in "${presets[@]}"; do
  default_methods=$ALL_METHODS
  [[ $preset == table7_* ]] && default_methods=$T7_METHODS
  for method in ${METHODS:-$default_methods}; do
    if [[ ! -f "$ROOT/conf/algo/$method.yaml" ]]; then
      echo "# skipping $method: conf/algo/$method.yaml does not exist" >&2
      continue
    fi
    args=("+experiment=diversifed_$preset" "algo=$method" "seed=$SEEDS")
    [[ -n "${COLUMNS[$preset]}" ]] && args+=(${COLUMN:-${COLUMNS[$preset]}})
    [[ -n "${ROUNDS:-}" ]] && args+=("rounds=$ROUNDS")
    args+=("hydra.sweep.dir=$OUT/$preset/$method" "${EXTRA_ARGS[@]}")
    sweep "${args[@]}"
  done
done

run_sweeps "DiversiFed ${presets[*]}"

tables=$(printf '%s\n' "${presets[@]}" | sed 's/_.*//' | sort -u)
for t in $tables; do
  run fedbench-report "$OUT" --preset "diversifed_$t"
done
finish

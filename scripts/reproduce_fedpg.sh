#!/usr/bin/env bash
# Reproduce the FedPG appendix's Tables 1-3 (docs/papers/fedpg.md,
# "The paper's tables and our presets"): for every column and method, one Hydra multirun per
# learning rate of the paper's grid {0.01, 0.05, 0.1} over the seeds; then the report prints
# each table in the paper's layout beside the paper's numbers, every cell from the best lr of
# its method and column (`fedbench-report --best-of optim.lr`: the highest mean over seeds of
# the personalized model's (L + S + G) / 3 at the last evaluation, `--best-by personal.LSG`),
# the lr it chose in the cell and every lr's score under the table.
#
#   scripts/reproduce_fedpg.sh                        # every table
#   scripts/reproduce_fedpg.sh table1_fmnist          # one column (a preset without "fedpg_")
#   scripts/reproduce_fedpg.sh table3                 # every column of a table
#   SEEDS=0 ROUNDS=100 LRS=0.05 METHODS="fedavg fedpg" scripts/reproduce_fedpg.sh table1_fmnist
#   DRY_RUN=1 scripts/reproduce_fedpg.sh table2       # print the commands only
#
# Environment: SEEDS (comma list, default 0,1,2,3,4: the paper's 5 runs), LRS (space list,
# default "0.01 0.05 0.1"), ROUNDS (default: the presets' 2000), METHODS (space list, default
# the table's rows; "fedpg@0.3" is the row "FedPG gamma=0.3", i.e. algo=fedpg algo.gamma=0.3),
# OUT (default multirun/fedpg), EXTRA (more overrides for every run, e.g. "device=cuda").
# The script only sweeps: a method's FedPG settings (the authors' FedAMP, APFL, FedFomo) are
# config (conf/paper_algo/fedpg/<algo>.yaml, chosen by the preset), so one cell of a table at
# one lr is `fedbench +experiment=fedpg_<preset> algo=<method> optim.lr=<lr> seed=<s>`.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"  # ROOT, EXTRA_ARGS, run, sweep, run_sweeps, finish
SEEDS="${SEEDS:-0,1,2,3,4}"
LRS="${LRS:-0.01 0.05 0.1}"
OUT="${OUT:-multirun/fedpg}"

T1_METHODS="local fedavg fedprox apfl pfedme ditto fedamp fedfomo fedrep fedrod splitgp fedmgda
fedpg sfedpg fedpg@0.3 fedpg@0.6 fedpg@1.0"
T3_METHODS="fedavg fedprox apfl pfedme ditto fedrep fedrod splitgp fedmgda fedpg"
ORDER="table1_fmnist table1_cifar10 table1_cifar100 table2_cifar10_p10 table2_cifar10_p50
table2_cifar10_p100 table3_fmnist_clean table3_fmnist_a1 table3_fmnist_a2"

presets=()
for arg in "${@:-all}"; do
  case "$arg" in
    all) read -r -a presets <<< "$(echo $ORDER)" ;;
    table1 | table2 | table3)
      for p in $ORDER; do [[ $p == "$arg"_* ]] && presets+=("$p"); done ;;
    *)
      [[ " $(echo $ORDER) " == *" $arg "* ]] || {
        echo "unknown table $arg; valid: all table1 table2 table3 $(echo $ORDER)" >&2
        exit 2
      }
      presets+=("$arg") ;;
  esac
done

for preset in "${presets[@]}"; do
  default_methods=$T1_METHODS
  [[ $preset == table3_* ]] && default_methods=$T3_METHODS
  for method in ${METHODS:-$default_methods}; do
    algo=${method%@*}
    if [[ ! -f "$ROOT/conf/algo/$algo.yaml" ]]; then
      echo "# skipping $method: conf/algo/$algo.yaml does not exist" >&2
      continue
    fi
    gamma=()
    [[ $method == *@* ]] && gamma=("algo.gamma=${method#*@}")
    for lr in $LRS; do
      args=("+experiment=fedpg_$preset" "algo=$algo" "seed=$SEEDS" "optim.lr=$lr"
        "${gamma[@]}")
      [[ -n "${ROUNDS:-}" ]] && args+=("rounds=$ROUNDS")
      args+=("hydra.sweep.dir=$OUT/$preset/$method/lr$lr" "${EXTRA_ARGS[@]}")
      sweep "${args[@]}"
    done
  done
done

run_sweeps "FedPG ${presets[*]}"

# one report per table over its columns' sweeps: the best lr per method and column
tables=$(printf '%s\n' "${presets[@]}" | sed 's/_.*//' | sort -u)
base="$OUT"
[[ $OUT == /* ]] || base="$ROOT/$OUT"
for t in $tables; do
  dirs=()
  for p in "${presets[@]}"; do
    [[ $p == "$t"_* ]] || continue
    if [[ -n "${DRY_RUN:-}" || -d "$base/$p" ]]; then
      dirs+=("$OUT/$p")
    else
      echo "# no runs in $OUT/$p: left out of fedpg_$t" >&2
    fi
  done
  (( ${#dirs[@]} )) || continue
  run fedbench-report "${dirs[@]}" --preset "fedpg_$t" --best-of optim.lr --best-by personal.LSG
done
finish

#!/usr/bin/env bash
# The leaderboard (docs/leaderboard.md): every registered algorithm with its tuned values
# (tuned=<federation>: <federation>/<algo>.yaml in conf/tuned/, from scripts/tune.sh) on each
# named federation (conf/federation/<name>.yaml), over 5 seeds; then the report
# (fedbench-report --preset leaderboard: ranks, Friedman and Nemenyi, paired differences from
# FedAvg and Local, the CD diagram, accuracy against communication and time).
#
#   scripts/leaderboard.sh                               # every tuned algorithm, both federations
#   FEDERATIONS=fmnist_pat2 ALGOS="fedavg ditto" SEEDS=0,1 scripts/leaderboard.sh
#   TUNED=0 scripts/leaderboard.sh                       # every algorithm at its defaults
#   DRY_RUN=1 scripts/leaderboard.sh                     # print the commands only
#
# One cell is one line: fedbench +federation=<fed> tuned=<fed> algo=<algo> seed=<s> (into its
# directory <OUT>/<fed>/<algo>/<overrides>/ when run by this script).
# Environment: FEDERATIONS (space list, default fmnist_pat2 fmnist_dir03), ALGOS (space list,
# default every registered algorithm), SEEDS (comma list, default 0,1,2,3,4), ROUNDS (default:
# the federation's), TUNED (1: tuned=<federation>, an algorithm without its conf/tuned file is
# skipped with a note; 0: every algorithm at its defaults), OUT (default results/leaderboard,
# results/leaderboard-defaults with TUNED=0), EXTRA (more overrides for every run, e.g.
# "engine.backend=sequential device=cpu"). Runs again skip finished cells and resume
# interrupted ones from their checkpoints (scripts/_common.sh).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"  # ROOT, EXTRA_ARGS, run, sweep, run_sweeps, finish
SEEDS="${SEEDS:-0,1,2,3,4}"
FEDERATIONS="${FEDERATIONS:-fmnist_pat2 fmnist_dir03}"
TUNED="${TUNED:-1}"
if [[ $TUNED == 1 ]]; then
  OUT="${OUT:-results/leaderboard}"
else
  OUT="${OUT:-results/leaderboard-defaults}"
fi
ALGOS="${ALGOS:-$(cd "$ROOT/conf/algo" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')}"

for fed in $FEDERATIONS; do
  if [[ ! -f "$ROOT/conf/federation/$fed.yaml" ]]; then
    echo "unknown federation $fed: no conf/federation/$fed.yaml" >&2
    exit 2
  fi
  for algo in $ALGOS; do
    tuned=()
    if [[ $TUNED == 1 ]]; then
      if [[ ! -f "$ROOT/conf/tuned/$fed/$algo.yaml" ]]; then
        echo "# skipping $algo on $fed: no conf/tuned/$fed/$algo.yaml (scripts/tune.sh $fed)" >&2
        continue
      fi
      tuned=("tuned=$fed")
    fi
    args=("+federation=$fed" "${tuned[@]}" "algo=$algo" "seed=$SEEDS")
    [[ -n "${ROUNDS:-}" ]] && args+=("rounds=$ROUNDS")
    args+=("hydra.sweep.dir=$OUT/$fed/$algo" "${EXTRA_ARGS[@]}")
    sweep "${args[@]}"
  done
done

run_sweeps "leaderboard"
if [[ -n "${DRY_RUN:-}" ]] || (cd "$ROOT" && [[ -d "$OUT" ]]); then
  run fedbench-report "$OUT" --preset leaderboard --format markdown --plots "$OUT/report" \
    --html "$OUT/leaderboard.html"
fi
finish

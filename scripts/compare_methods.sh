#!/usr/bin/env bash
# The methods in no paper family (docs/algorithms.md) side by side with FedAvg and Local on one
# FMNIST federation none of the tests uses, each at its YAML defaults: a check that every
# method learns on a realistic split with its paper's settings, and the ranking to set beside
# the one its paper reports (docs/algorithms.md, "Side by side").
#
#   scripts/compare_methods.sh                         # the table of docs/algorithms.md
#   SEEDS=0,1,2 ROUNDS=100 scripts/compare_methods.sh  # more seeds, longer
#   METHODS="fedavg fedala" EXTRA="device=cuda" scripts/compare_methods.sh
#   DRY_RUN=1 scripts/compare_methods.sh               # print the commands only
#
# The federation: FMNIST, 20 clients, label skew Dir(0.3 * 1) per client (300 training and 100
# test samples each, the test set of the client's own class mix), LeNet-5 with BatchNorm
# (every method's BatchNorm rule applies), all clients every round, E = 1, batch 10, SGD lr
# 0.05. Environment: SEEDS (default 0), ROUNDS (default 50), METHODS (space list), OUT
# (default multirun/compare), EXTRA (more overrides for every run). Runs again skip finished
# cells and resume interrupted ones (scripts/_common.sh).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"  # ROOT, EXTRA_ARGS, run, sweep, run_sweeps, finish
SEEDS="${SEEDS:-0}"
ROUNDS="${ROUNDS:-50}"
OUT="${OUT:-multirun/compare}"
METHODS="${METHODS:-fedavg local fedbn fedbabu moon fedala fedpac gpfl fedcp feddbe pfedla cfl
ifca fedem knnper}"

FEDERATION=(data=fmnist clients=20 split=dir split.dir_mode=per_client split.dir_prior=ones
  split.alpha=0.3 split.train_per_client=300 split.test_per_client=100 model=cnn
  model.preset=lenet model.norm=batch participation=1.0 local_epochs=1 batch_size=10
  optim.lr=0.05 eval.every=5)

for method in $METHODS; do
  sweep "algo=$method" "seed=$SEEDS" "rounds=$ROUNDS" "${FEDERATION[@]}" \
    "hydra.sweep.dir=$OUT/$method" "${EXTRA_ARGS[@]}"
done
run_sweeps "compare_methods"
run fedbench-report "$OUT"
finish

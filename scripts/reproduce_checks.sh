#!/usr/bin/env bash
# The runs behind the numbers that docs/reproduction/ gives beside the paper tables: the
# checks of a gap's reason, more seeds, sweeps of a method's setting, shorter budgets. Each
# check is a named group of cells, run as the table scripts run theirs (one `fedbench -m ...
# resume=auto` per sweep into OUT/<check>/, finished cells skipped, interrupted ones resumed);
# scripts/export_results.sh OUT/<check> results/checks/<check> then pins them, and the page
# prints them with `fedbench-report results/checks/<check> ...` (generated tables).
#
#   scripts/reproduce_checks.sh                          # every check (hours of one core)
#   scripts/reproduce_checks.sh diversifed_tau fedslr_mlp
#   DRY_RUN=1 scripts/reproduce_checks.sh                # the commands only
#   scripts/reproduce_checks.sh --list                   # the checks and what they back
#
# Environment: OUT (sweep root, default multirun/checks), EXTRA (more overrides for every
# run). The cells' settings are the ones their page states; a check's seeds and rounds are
# part of it (no SEEDS/ROUNDS here).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"  # ROOT, EXTRA_ARGS, sweep, run_sweeps, finish
OUT="${OUT:-multirun/checks}"
T1="+experiment=diversifed_table1_fmnist"
T2=("+experiment=diversifed_table2_fmnist" "split.alpha=0.1")
SLR="+experiment=fedslr_fmnist_dir"
LENET=("model=cnn" "model.preset=lenet" "~model.hidden")
# scripts/compare_methods.sh's federation (FMNIST, 20 clients, Dir(0.3 * 1) per client, 300 / 100
# samples, every client every round, E = 1, batch 10), without its model
DIR03=(data=fmnist clients=20 split=dir split.dir_mode=per_client split.dir_prior=ones
  split.alpha=0.3 split.train_per_client=300 split.test_per_client=100 participation=1.0
  local_epochs=1 batch_size=10 eval.every=5)
MLP64=(model=mlp "model.hidden=[64]")

declare -A ABOUT=(
  [diversifed_t2_fedavg_seeds]="DiversiFed Table II FMNIST Dir 0.1: FedAvg seeds 1-2 at 500 rounds (seed 0 is the table's)"
  [diversifed_t2_40]="DiversiFed Table II FMNIST Dir 0.1: the methods without a full-length cell, 40 rounds"
  [diversifed_seeds_40]="DiversiFed against Separate (and FedAvg) over more seeds, pat-2 and Dir 0.1, 40 rounds"
  [diversifed_tau]="DiversiFed's tau, start and kept Adam state, Dir 0.1 (FedAvg on pat-2), 40 rounds"
  [pfedme_local_500]="pFedMe scored on w_i (algo.eval_model=local), DiversiFed Table I FMNIST, 500 rounds"
  [apple_norm]="APPLE, DiversiFed, FedAMP, Separate on ResNet-8 with BatchNorm and GroupNorm, 5 rounds"
  [fedpg_short]="FedPG Tables 1 and 3 FMNIST scaled: FedPG 150 rounds, FedAvg and Local 40 rounds at E = 1"
  [fedpg_a2_lr]="FedPG under A2 at lr 0.1 and 0.05, and mu_rule=median at 0.1, 2000 rounds"
  [fedslr_mlp]="FedSLR's FMNIST Dir 0.1 run (MLP 784-200-10) and its baselines, 30 and 80 rounds"
  [fedslr_lenet]="FedSLR's FMNIST Dir 0.1 run on LeNet-5 and its baselines, 30 rounds, seeds 0-2"
  [diversifed_prior]="DiversiFed Table II's Dirichlet prior: Separate at alpha 0.1/0.5/1.0, ones against shares, 25 rounds"
  [compare_methods]="docs/algorithms.md's side by side: 15 methods at their defaults, FMNIST Dir 0.3, BN LeNet, 50 rounds"
  [method_settings]="docs/algorithms.md's notes: MOON's mu, FedCP's lambda, FedDBE's kappa, pFedLA's sign, FMNIST Dir 0.3, 20 rounds"
  [tuned_transfer]="fmnist_pat2's tuned values against the defaults off the leaderboard: pat-3 clients, seeds 10-12, 100 rounds"
  [tuned_transfer_dir]="fmnist_dir03's tuned values against the defaults off the leaderboard: Dir(0.1) clients, seeds 10-12, 100 rounds"
)
ORDER="diversifed_t2_fedavg_seeds diversifed_t2_40 diversifed_seeds_40 diversifed_tau
fedpg_short fedslr_mlp fedslr_lenet diversifed_prior compare_methods method_settings tuned_transfer
tuned_transfer_dir pfedme_local_500 apple_norm
fedpg_a2_lr"

plan() {  # the sweeps of check $1, each into OUT/$1
  local d="hydra.sweep.dir=$OUT/$1"
  case "$1" in
    diversifed_t2_fedavg_seeds)
      sweep "${T2[@]}" algo=fedavg seed=1,2 "$d" ;;
    diversifed_t2_40)
      sweep "${T2[@]}" algo=perfedavg,fedfomo,apple,fedproto,fedcac seed=0 rounds=40 "$d"
      sweep "${T2[@]}" algo=pfedme algo.eval_model=theta,local seed=0 rounds=40 "$d" ;;
    diversifed_seeds_40)
      sweep "$T1" algo=diversifed,local,fedavg seed=1,2 rounds=40 "$d"
      sweep "${T2[@]}" algo=diversifed,local seed=1,2,3,4 rounds=40 "$d" ;;
    diversifed_tau)
      sweep "${T2[@]}" algo=diversifed algo.tau=0.5,0.7,0.9,1.1,1.5,2.0,3.0 seed=0 rounds=40 "$d"
      sweep "${T2[@]}" algo=diversifed algo.tau=1.1 seed=1,2,3,4 rounds=40 "$d"
      sweep "${T2[@]}" algo=diversifed algo.start=own seed=0 rounds=40 "$d"
      sweep "${T2[@]}" algo=diversifed,local optim.persist_state=true seed=0,1,2,3,4 rounds=40 "$d"
      sweep "$T1" algo=fedavg optim.persist_state=true seed=0,1,2 rounds=40 "$d" ;;
    diversifed_prior)
      sweep "${T2[0]}" algo=local split.alpha=0.1,0.5,1.0 split.dir_prior=ones,shares seed=0 \
        rounds=25 "$d" ;;
    compare_methods)  # scripts/compare_methods.sh's federation and methods, into this folder
      OUT="$OUT/$1" EXTRA="${EXTRA:-}" DRY_RUN="${DRY_RUN:-}" bash "$ROOT/scripts/compare_methods.sh" \
        || SWEEPS_FAILED=$((SWEEPS_FAILED + 1)) ;;
    pfedme_local_500)
      sweep "$T1" algo=pfedme algo.eval_model=local seed=0 "$d" ;;
    apple_norm)
      sweep algo=apple,local model=resnet8 model.norm=batch,group split.classes_per_client=2 \
        clients=4 participation=1.0 rounds=5 local_epochs=2 split.train_per_client=1000 \
        eval.every=5 seed=0,1,2,3,4 "$d"
      sweep "$T1" algo=apple,diversifed,fedamp,local model=resnet8 "~model.hidden" \
        model.norm=batch,group clients=4 rounds=5 local_epochs=2 eval.every=5 seed=0,1,2,3,4 "$d" ;;
    fedpg_short)
      sweep +experiment=fedpg_table3_fmnist_clean,fedpg_table3_fmnist_a1 algo=fedpg \
        optim.lr=0.1 rounds=150 seed=0 "$d"
      sweep +experiment=fedpg_table3_fmnist_a2 algo=fedpg optim.lr=0.01 rounds=150 seed=0 "$d"
      sweep +experiment=fedpg_table3_fmnist_clean,fedpg_table3_fmnist_a1,fedpg_table3_fmnist_a2 \
        algo=fedavg optim.lr=0.05 local_epochs=1 rounds=40 eval.every=10 seed=0 "$d"
      sweep +experiment=fedpg_table3_fmnist_clean algo=local optim.lr=0.05 local_epochs=1 \
        rounds=40 eval.every=10 seed=0 "$d" ;;
    method_settings)  # each at the defaults but the named keys, 20 rounds, seed 0
      sweep "${DIR03[@]}" model=cnn model.preset=lenet model.norm=batch algo=moon algo.mu=1,5 \
        optim.lr=0.05 rounds=20 seed=0 "$d"
      sweep "${DIR03[@]}" "${MLP64[@]}" algo=fedcp algo.lam=0,5 optim.lr=0.05 rounds=20 seed=0 "$d"
      sweep "${DIR03[@]}" "${MLP64[@]}" algo=fedcp algo.lam=5 optim.lr=0.01 rounds=20 seed=0 "$d"
      sweep "${DIR03[@]}" "${MLP64[@]}" algo=feddbe algo.kappa=0,50 optim.lr=0.05 rounds=20 \
        seed=0 "$d"
      sweep "${DIR03[@]}" "${MLP64[@]}" algo=pfedla algo.hn_lr=0.005,10 \
        algo.delta=sent_minus_trained,trained_minus_sent optim.lr=0.05 rounds=20 seed=0 "$d" ;;
    tuned_transfer)  # docs/leaderboard.md: do the winners carry over to clients and seeds the
      # studies never saw? fmnist_pat2 but 3 classes per client, seeds 10-12 (the studies used
      # seed 100, the leaderboard 0-4); the methods whose defaults docs/algorithms.md discusses,
      # and four references
      sweep +federation=fmnist_pat2 split.classes_per_client=3 tuned=none,fmnist_pat2 \
        algo=fedavg,local,ditto,apfl,fedcp,feddbe,pfedla,cfl seed=10,11,12 "$d" ;;
    tuned_transfer_dir)  # the same for fmnist_dir03's winners: its clients at Dir(0.1)
      # instead of Dir(0.3), seeds 10-12; the methods significantly above FedAvg there (but
      # pFedMe, the costliest), the two with defaults from other settings, and two references
      sweep +federation=fmnist_dir03 split.alpha=0.1 tuned=none,fmnist_dir03 \
        algo=fedavg,local,fedpac,fedslr,fedspa,fedala,fedcp,cfl seed=10,11,12 "$d" ;;
    fedpg_a2_lr)
      sweep +experiment=fedpg_table3_fmnist_a2 algo=fedpg optim.lr=0.1,0.05 seed=0 "$d"
      sweep +experiment=fedpg_table3_fmnist_a2 algo=fedpg algo.mu_rule=median optim.lr=0.1 \
        seed=0 "$d" ;;
    fedslr_mlp)
      sweep "$SLR" algo=fedslr algo.rank_penalty=3e-3 algo.p_init=copy,zero seed=0,1 "$d"
      sweep "$SLR" algo=fedavg,ditto,lg_fedavg,feddyn,scaffold seed=0,1 "$d"
      sweep "$SLR" algo=fedslr algo.rank_penalty=3e-3 rounds=80 seed=0 "$d"
      sweep "$SLR" algo=fedavg,ditto,lg_fedavg rounds=80 seed=0 "$d" ;;
    fedslr_lenet)
      sweep "$SLR" "${LENET[@]}" algo=fedslr algo.rank_penalty=3e-3 seed=0,1,2 "$d"
      sweep "$SLR" "${LENET[@]}" algo=fedavg,ditto,lg_fedavg seed=0,1,2 "$d"
      sweep "$SLR" "${LENET[@]}" algo=feddyn,scaffold seed=0 "$d" ;;
  esac
}

checks=()
for arg in "${@:-all}"; do
  case "$arg" in
    all) read -r -a checks <<< "$(echo $ORDER)" ;;
    --list)
      for c in $ORDER; do printf '%-28s %s\n' "$c" "${ABOUT[$c]}"; done
      exit 0 ;;
    *)
      [[ -v "ABOUT[$arg]" ]] || { echo "unknown check $arg; valid: all --list $(echo $ORDER)" >&2; exit 2; }
      checks+=("$arg") ;;
  esac
done

for c in "${checks[@]}"; do
  plan "$c"
  if (( ${#EXTRA_ARGS[@]} )); then  # EXTRA into every planned sweep
    for i in "${!SWEEPS[@]}"; do SWEEPS[i]="${SWEEPS[i]} $(_words "${EXTRA_ARGS[@]}")"; done
  fi
  run_sweeps "check $c"
done
finish

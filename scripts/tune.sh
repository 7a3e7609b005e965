#!/usr/bin/env bash
# Equal-budget tuning of every algorithm on the leaderboard's federations (docs/leaderboard.md):
# one study per algorithm and federation (python -m fedbench.tune), with the same number of
# trials, the same rounds and seeds for every method, and the validation objective
# (objective.metric=auto: the personalized model's V avg at the validation-selected round).
# Each study's winner goes to conf/tuned/ as <federation>/<algo>.yaml, which tuned=<federation>
# applies (scripts/leaderboard.sh runs every method so).
#
#   scripts/tune.sh                                  # every algorithm on both federations
#   scripts/tune.sh fmnist_pat2                      # one federation
#   ALGOS="fedavg ditto" TRIALS=4 ROUNDS=20 scripts/tune.sh fmnist_pat2   # a quick look
#   DRY_RUN=1 scripts/tune.sh                        # where each study stands; nothing runs
#
# Environment: FEDERATIONS (space list; default fmnist_pat2 fmnist_dir03, or the arguments),
# ALGOS (space list, default: every registered algorithm), TRIALS (default 12), SEEDS (comma
# list: every trial's seeds, default 100, apart from the leaderboard's 0-4), ROUNDS (default:
# the federation's), OUT (the studies, default multirun/tune), TUNED_DIR (where the winners
# go, default conf/tuned), EXTRA (more overrides for every run, e.g. "engine.backend=sequential
# device=cpu"), PYTHON (default python). Needs optuna: pip install 'fedbench[optuna]'.
# Run it again after an interruption (a kill, a reboot): finished trials are kept, the
# interrupted one resumes its runs from their checkpoints, and the study draws what it would
# have drawn uninterrupted (fedbench/tune.py).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
FEDERATIONS="${*:-${FEDERATIONS:-fmnist_pat2 fmnist_dir03}}"
ALGOS="${ALGOS:-all}"
args=(--trials "${TRIALS:-12}" --seeds "${SEEDS:-100}" --out "${OUT:-multirun/tune}"
  --algos "$(echo $ALGOS | tr ' ' ',')")
[[ -n "${ROUNDS:-}" ]] && args+=(--rounds "$ROUNDS")
[[ -n "${TUNED_DIR:-}" ]] && args+=(--tuned-dir "$TUNED_DIR")
[[ -n "${DRY_RUN:-}" ]] && args+=(--dry-run)

status=0
for fed in $FEDERATIONS; do
  echo "+ ${PYTHON:-python} -m fedbench.tune $fed ${args[*]} ${EXTRA_ARGS[*]}"
  (cd "$ROOT" && "${PYTHON:-python}" -m fedbench.tune "$fed" "${args[@]}" "${EXTRA_ARGS[@]}") \
    || status=$?
  # an interruption stops here (run the script again); a study without a winner does not
  (( status == 0 || status == 1 )) || exit "$status"
done
exit "$status"

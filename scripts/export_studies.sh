#!/usr/bin/env bash
# Copy the records of tuning studies (python -m fedbench.tune / scripts/tune.sh) into
# results/tune/ (or DEST), then write the winner of every study that has all its trials into
# conf/tuned/ from those records (python -m fedbench.tune on the copied study: it runs nothing
# when every trial is done, writes <federation>/<algo>.yaml with the study's path in results/
# in its header, and checks that tuned=<federation> applies it).
#
# Kept: each study's study.json (what makes the study) and trial_NNN/trial.json (the trial's
# values, state, objective and the one-line command of each of its runs). Not kept: the
# trials' run folders (checkpoints, metrics), which only a running study needs. A study
# copied back into a study folder (cp -r results/tune/<fed> multirun/tune/) continues from
# its records: finished trials are kept, the next trial is drawn from them.
#
#   scripts/export_studies.sh multirun/tune              # -> results/tune, conf/tuned
#   scripts/export_studies.sh /scratch/tune results/tune
#
# Environment: TRIALS (the studies' number of trials, default 12 as scripts/tune.sh: a study
# with fewer done is copied and has no winner yet), TUNED_DIR (where the winners go, default
# conf/tuned), PYTHON (default python).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${1:?usage: scripts/export_studies.sh <studies folder> [<dest>]}"
[[ -d $SRC ]] || { echo "no folder $SRC" >&2; exit 2; }
DEST="${2:-$ROOT/results/tune}"
PY="${PYTHON:-python}"
TRIALS="${TRIALS:-12}"
n=0
declare -A complete=()  # federation -> comma list of its studies with all their trials
while IFS= read -r -d '' study; do
  folder=$(dirname "$study")
  algo=$(basename "$folder")
  fed=$(basename "$(dirname "$folder")")
  to="$DEST/$fed/$algo"
  mkdir -p "$to"
  cp "$study" "$to/"
  while IFS= read -r -d '' trial; do
    t=$(basename "$(dirname "$trial")")
    mkdir -p "$to/$t"
    cp "$trial" "$to/$t/"
  done < <(find "$folder" -mindepth 2 -maxdepth 2 -name trial.json -print0)
  n=$((n + 1))
  if "$PY" -c '
import json, sys
from pathlib import Path
paths = sorted(Path(sys.argv[1]).glob("trial_*/trial.json"))[: int(sys.argv[2])]
done = [p for p in paths if json.loads(p.read_text())["state"] in ("complete", "failed")]
sys.exit(0 if len(done) == int(sys.argv[2]) else 1)' "$to" "$TRIALS"; then
    complete[$fed]="${complete[$fed]:+${complete[$fed]},}$algo"
  fi
done < <(find "$SRC" -mindepth 3 -maxdepth 3 -name study.json -print0 | sort -z)
echo "$n study record(s) copied to $DEST"
out=$(realpath "$DEST")
[[ $out == "$ROOT"/* ]] && out=${out#"$ROOT"/}  # the winners' headers: results/tune/...
for fed in "${!complete[@]}"; do
  # the study's own settings come from its study.json (fedbench.tune refuses a folder made
  # with other settings): read back, not assumed
  read -r seeds rounds startup sampler objective overrides < <("$PY" -c '
import json, sys
i = json.load(open(sys.argv[1]))["identity"]
print(",".join(map(str, i["seeds"])), i["rounds"], i["sampler"]["startup"], i["sampler"]["seed"],
      i["objective"], " ".join(i["overrides"]) or "-")' "$DEST/$fed/${complete[$fed]%%,*}/study.json")
  extra=()
  [[ $overrides != - ]] && read -r -a extra <<< "$overrides"
  [[ -n ${TUNED_DIR:-} ]] && extra+=(--tuned-dir "$TUNED_DIR")
  (cd "$ROOT" && "$PY" -m fedbench.tune "$fed" --algos "${complete[$fed]}" --trials "$TRIALS" \
    --seeds "$seeds" --rounds "$rounds" --startup "$startup" --sampler-seed "$sampler" \
    --objective "$objective" --out "$out" --quiet "${extra[@]}")
done

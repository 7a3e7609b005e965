#!/usr/bin/env bash
# Copy every finished cell under a table's output folder into results/ (or DEST), keeping
# only the small files a report and a later resume=auto need: summary.json, metrics.csv
# and .hydra/{config,overrides}.yaml (no checkpoint, clients.csv, partition or log).
#
#   scripts/export_results.sh multirun/diversifed            # -> results/diversifed/...
#   scripts/export_results.sh /scratch/me/fedpg results/fedpg
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${1:?usage: scripts/export_results.sh <table output folder> [<dest>]}"
[[ -d $SRC ]] || { echo "no folder $SRC" >&2; exit 2; }
DEST="${2:-$ROOT/results/$(basename "$SRC")}"
n=0
while IFS= read -r -d '' summary; do
  cell=$(dirname "$summary")
  [[ -f $cell/.hydra/config.yaml && -f $cell/metrics.csv ]] || continue
  to="$DEST/${cell#"$SRC"/}"
  mkdir -p "$to/.hydra"
  cp "$cell/summary.json" "$cell/metrics.csv" "$to/"
  cp "$cell/.hydra/config.yaml" "$cell/.hydra/overrides.yaml" "$to/.hydra/"
  n=$((n + 1))
done < <(find "$SRC" -name summary.json -print0)
echo "$n finished cell(s) copied to $DEST"

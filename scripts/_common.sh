# Shared by the reproduce_*.sh table scripts (sourced, not run).
#
# A table is a list of sweeps, each into a fixed directory, so that every cell (one job of a
# sweep) has a fixed run directory: `sweep` plans one `fedbench -m ... resume=auto`, and
# `run_sweeps` prints where the table stands (fedbench-status: cells done, running, left, the
# time left at the measured seconds per round), runs every sweep, and prints it again. Run
# the script again after an interruption (a kill, a preempted job, a reboot): finished cells
# are skipped, interrupted ones resume from their checkpoints, exactly (resume=auto).
# DRY_RUN=1 prints the commands only. `run` prints and runs any other command (the reports).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
SWEEPS=()       # the planned sweeps, each its fedbench -m arguments as one quoted line
SWEEPS_FAILED=0 # sweeps that ended with failed or refused cells

# Shell words for a line: quoted only where a word needs it, so the commands read as typed.
_words() {
  local out=() w q
  for w in "$@"; do
    if [[ $w =~ ^[][A-Za-z0-9_.,=+/@:%~^-]+$ ]]; then
      out+=("$w")
    elif [[ $w != *"'"* ]]; then
      out+=("'$w'")
    else
      printf -v q '%q' "$w"
      out+=("$q")
    fi
  done
  echo "${out[*]}"
}

run() {
  echo "+ $(_words "$@")"
  [[ -n "${DRY_RUN:-}" ]] || (cd "$ROOT" && "$@")
}

# sweep ARG...: plan `fedbench -m ARG... resume=auto` (the arguments include hydra.sweep.dir).
# A cell's directory is named by its overrides alone (not Hydra's job number, which moves
# when SEEDS or a column list changes), so the same cell is found by any later sweep; a name
# too long for a file name is cut and ends in a digest of the whole (fedbench.cell_name).
CELL_SUBDIR='hydra.sweep.subdir=${fedbench.cell:}'
sweep() {
  SWEEPS+=("$(_words "$@" "$CELL_SUBDIR" resume=auto)")
}

# run_sweeps LABEL: run the planned sweeps (see above); then SWEEPS is empty again.
run_sweeps() {
  local label=$1 line plan
  local -a args
  if [[ -n "${DRY_RUN:-}" ]]; then
    for line in "${SWEEPS[@]}"; do echo "+ fedbench -m $line"; done
    SWEEPS=()
    return 0
  fi
  (( ${#SWEEPS[@]} )) || return 0
  plan=$(mktemp)
  printf '%s\n' "${SWEEPS[@]}" > "$plan"
  (cd "$ROOT" && fedbench-status --plan "$plan" --label "$label") || true
  for line in "${SWEEPS[@]}"; do
    eval "args=($line)"
    echo "+ fedbench -m $line"
    (cd "$ROOT" && fedbench -m "${args[@]}") || SWEEPS_FAILED=$((SWEEPS_FAILED + 1))
  done
  (cd "$ROOT" && fedbench-status --plan "$plan" --label "$label") || true
  rm -f "$plan"
  SWEEPS=()
}

# The script's exit: 1 when a sweep had failed cells (listed above by fedbench), else 0.
finish() {
  if (( SWEEPS_FAILED )); then
    echo "$SWEEPS_FAILED sweep(s) had failed or refused cells (listed above): fix the cause and" \
      "run the same command again; finished cells are skipped" >&2
    exit 1
  fi
}

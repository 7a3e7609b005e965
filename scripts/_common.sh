# Shared by the reproduce_*.sh table scripts (sourced, not run): the repository root, the
# EXTRA overrides as an array, and `run`, which prints each command and runs it from the
# root unless DRY_RUN is set.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"

run() {
  echo "+ $*"
  [[ -n "${DRY_RUN:-}" ]] || (cd "$ROOT" && "$@")
}

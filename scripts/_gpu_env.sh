# Shared by scripts/gpu_check.sh and scripts/gpu_bench.sh (sourced, not run): the Python
# packages and the data a GPU machine without network needs, from the folders that
# scripts/gpu_wheels.sh prepared and the device call carried (docs/gpu.md).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHL="$ROOT/.whl"
CARRIED_FMNIST="$ROOT/.gpu-data/fashion-mnist"

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# gpu_env: make hydra, omegaconf and cvxopt importable (from .whl when missing) and point the
# data root at the carried Fashion-MNIST; exports PYTHONPATH (the checkout first) and
# FEDBENCH_DATA.
gpu_env() {
  local need="import hydra, omegaconf, cvxopt, pandas, matplotlib, tqdm, yaml, torch"
  if ! "$PY" -c "$need" 2>/dev/null; then
    compgen -G "$WHL/*.whl" >/dev/null \
      || die "$PY cannot import fedbench's dependencies and $WHL holds no wheels: run scripts/gpu_wheels.sh where pip has network, and carry .whl"
    echo "installing $(ls "$WHL" | tr '\n' ' ')"
    # Into the interpreter's own environment, so that the Python processes tests start with
    # their own PYTHONPATH find them too; where that is refused, a folder on PYTHONPATH.
    if ! "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      "$WHL"/*.whl; then
      echo "warning: installing into $PY's environment failed; using --target /tmp/site (tests that start Python with their own PYTHONPATH will not find the packages)" >&2
      "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --upgrade --target /tmp/site "$WHL"/*.whl || die "pip could not install the wheels in $WHL"
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "$need" || die "the dependencies are still not importable after installing $WHL"
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  if [[ -z "${FEDBENCH_DATA:-}" && -s "$CARRIED_FMNIST/train-images-idx3-ubyte.gz" ]]; then
    # a data root of our own that links the carried files: fedbench's decoded-data cache is
    # written beside them in the data root, and must not grow the carried folder
    FEDBENCH_DATA="$(mktemp -d "${TMPDIR:-/tmp}/fedbench-data.XXXXXX")"
    ln -s "$CARRIED_FMNIST" "$FEDBENCH_DATA/fashion-mnist"
    export FEDBENCH_DATA
    trap 'rm -rf "$FEDBENCH_DATA"' EXIT  # the link and the cache, not the carried files
  fi
  if [[ -z "${FEDBENCH_DATA:-}" && ! -s /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]]; then
    die "no Fashion-MNIST: run scripts/gpu_wheels.sh and carry .gpu-data/fashion-mnist, or set FEDBENCH_DATA"
  fi
  echo "python $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'); data root ${FEDBENCH_DATA:-/usr/share/datasets}"
}

# need_device DEVICE: exit 2 unless DEVICE (cpu, cuda, cuda:N) is usable here.
need_device() {
  case "$1" in
    cpu) ;;
    cuda | cuda:*)
      "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || die "device $1: no CUDA GPU is visible to torch here (run on the CPU with --device cpu)"
      ;;
    *) die "device $1: use cuda, cuda:N or cpu" ;;
  esac
}

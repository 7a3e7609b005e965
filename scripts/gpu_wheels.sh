#!/usr/bin/env bash
# Prepare, on a machine with network, what scripts/gpu_check.sh and scripts/gpu_bench.sh need
# on a GPU machine that has none (docs/gpu.md):
#   .whl/                        wheels for Python 3.12 / manylinux x86_64 of the packages
#                                fedbench needs that the GPU image lacks
#   .gpu-data/fashion-mnist/     the four Fashion-MNIST .gz files (31 MB)
# Both folders are git-ignored; a GPU call carries them (carry: .whl, .gpu-data/fashion-mnist).
#
#   scripts/gpu_wheels.sh        # idempotent: what is there already is kept
#
# The GPU image (Python 3.12, torch, numpy, pandas, matplotlib, pillow, pyyaml, tqdm, pytest,
# pytest-xdist, packaging ...) lacks four of fedbench's dependencies, found by resolving
# `pip install --dry-run ".[dev]"` against its package list: hydra-core, omegaconf,
# antlr4-python3-runtime (hydra's and omegaconf's parser) and cvxopt. The versions are the
# ones fedbench is developed and tested with.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="$ROOT/.whl"
DATA="$ROOT/.gpu-data/fashion-mnist"
FMNIST_SRC="${FMNIST_SRC:-/usr/share/datasets/fashion-mnist}"
PY="${PYTHON:-python3}"
LIMIT_MB=55  # with the ~6 MB working tree, under the device call's 64 MiB

# pure-Python wheels (py3-none-any) and one compiled for CPython 3.12 on manylinux x86_64
PURE=(hydra-core==1.3.8 omegaconf==2.3.1)
BINARY=(cvxopt==1.3.3)
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)  # on PyPI as a source archive only: built here
FILES=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz
  t10k-labels-idx1-ubyte.gz)

die() { echo "gpu_wheels.sh: $*" >&2; exit 2; }

mkdir -p "$WHL" "$DATA"
have() {  # have NAME==VERSION: a wheel of it is in .whl already
  local name=${1%%==*} version=${1##*==}
  compgen -G "$WHL/${name//-/_}-${version}-*.whl" >/dev/null
}

PIP=("$PY" -m pip -q --disable-pip-version-check)
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)
for req in "${PURE[@]}" "${BINARY[@]}"; do
  have "$req" && continue
  echo "downloading $req"
  "${PIP[@]}" download --no-deps --only-binary=:all: "${TARGET[@]}" -d "$WHL" "$req" \
    || die "pip could not download $req for Python 3.12 manylinux x86_64"
done
for req in "${SDIST_ONLY[@]}"; do
  have "$req" && continue
  echo "building a wheel of $req (pure Python)"
  "${PIP[@]}" wheel --no-deps --no-binary=:all: -w "$WHL" "$req" \
    || die "pip could not build a wheel of $req"
done
for f in "$WHL"/*.whl; do  # the sdist-built wheel must be pure Python to run on the GPU image
  case "$(basename "$f")" in
    *-py3-none-any.whl | *-py2.py3-none-any.whl | *-cp312-cp312-manylinux*x86_64.whl) ;;
    *) die "$(basename "$f") is not for Python 3.12 manylinux x86_64; delete it and run again" ;;
  esac
done
n_names=$(for f in "$WHL"/*.whl; do basename "$f" | cut -d- -f1; done | sort | uniq -d | wc -l)
((n_names == 0)) || die "two versions of one package in $WHL (pip would refuse to install them)"

for f in "${FILES[@]}"; do
  [[ -s "$DATA/$f" ]] && continue
  [[ -s "$FMNIST_SRC/$f" ]] || die "$FMNIST_SRC/$f not found (apt-get install dataset-fashion-mnist, or set FMNIST_SRC)"
  cp "$FMNIST_SRC/$f" "$DATA/$f"
done

total_kb=$(du -skL "$WHL" "$DATA" | awk '{s += $1} END {print s}')
du -shL "$WHL" "$DATA"
ls -1 "$WHL"
((total_kb <= LIMIT_MB * 1024)) || die "wheels and data take $((total_kb / 1024)) MiB, over ${LIMIT_MB} MiB"
echo "ready: $((total_kb / 1024)) MiB; a GPU call carries [\".whl\", \".gpu-data/fashion-mnist\"]"

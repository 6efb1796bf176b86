#!/usr/bin/env bash
# Create (or reuse) the virtualenv .venv in the repository root and install dstc into it, editable, with the whole
# toolchain (the build and ray extras); then optimum-intel's own virtualenv .venv-optimum-intel beside it
# (requirements-optimum-intel.txt). Arguments name extras to add, e.g. `./install.sh test`; options:
#   --serve-only          the base install only: serve, generate, verify and gate artifacts (no torch, NNCF, Ray)
#   --no-optimum-intel    no .venv-optimum-intel (also DSTC_NO_OPTIMUM_INTEL=1); CI jobs do not use it
#   --torch-index-url URL where torch comes from besides the configured indexes: on a stock machine PyTorch's CPU
#                         wheels, https://download.pytorch.org/whl/cpu (also DSTC_TORCH_INDEX_URL)
# PYTHON picks the interpreter (default python3.11).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3.11}
optimum_intel=$([ "${DSTC_NO_OPTIMUM_INTEL:-}" = 1 ] && echo no || echo yes)
torch_index=${DSTC_TORCH_INDEX_URL:-}
toolchain=build,ray
extras=()
while [ $# -gt 0 ]; do
    case $1 in
        --serve-only) toolchain=""; optimum_intel=no ;;
        --no-optimum-intel) optimum_intel=no ;;
        --torch-index-url) torch_index=${2:?--torch-index-url needs a URL}; shift ;;
        --torch-index-url=*) torch_index=${1#*=} ;;
        -*) echo "install.sh: unknown option $1 (see the top of install.sh)" >&2; exit 2 ;;
        *) extras+=("$1") ;;
    esac
    shift
done
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }
install_torch() {  # $1: the pip function of the environment
    # torch first and exactly: 2.13.0 is the CPU build this project is tested with; a looser requirement, or the
    # default index alone, lets pip resolve a CUDA build of several GB
    "$1" install -q ${torch_index:+--extra-index-url "$torch_index"} torch==2.13.0
}
if [ -n "$toolchain" ]; then
    install_torch pip
    # PyPI's torchvision does not import beside this torch build, and transformers then fails to import the
    # DeepSeek models. dstc does not use it: remove it if an earlier install brought it into this venv.
    if pip show -q torchvision >/dev/null 2>&1; then pip uninstall -q -y torchvision; fi
fi
# optimum-intel requires transformers<5.6 and does not import beside dstc's transformers (docs/install-and-develop.md, "Install"):
# it lives in .venv-optimum-intel. Remove it if an earlier install left it here.
if pip show -q optimum-intel >/dev/null 2>&1; then pip uninstall -q -y optimum-intel; fi
all=$(IFS=,; echo "${toolchain}${toolchain:+${extras[*]:+,}}${extras[*]:-}")
pip install -q -e ".${all:+[$all]}"
echo "dstc installed in $(pwd)/.venv (.venv/bin/dstc), extras: ${all:-none (serve only)}"

[ "$optimum_intel" = yes ] || exit 0
[ -x .venv-optimum-intel/bin/python ] || "$python" -m venv .venv-optimum-intel
oi_pip() { .venv-optimum-intel/bin/python -m pip --disable-pip-version-check "$@"; }
install_torch oi_pip
oi_pip install -q -r requirements-optimum-intel.txt
echo "optimum-intel installed in $(pwd)/.venv-optimum-intel"

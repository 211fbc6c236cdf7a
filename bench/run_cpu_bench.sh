#!/usr/bin/env bash
# Builds and runs the CPU microbenchmarks: bench_core (C++) and
# bench_binding.py (the same engine step through the Python binding).
#
# Usage: bench/run_cpu_bench.sh [--quick]
#   --quick  fewer repetitions (a smoke test)
# Environment: JOBS (parallel build jobs, default 2), PYTHON (interpreter for
# bench_binding.py; default .venv/bin/python of the repository if present, else python3).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/.." && pwd)"
cd "${root}"

quick=()
for arg in "$@"; do
  case "${arg}" in
    --quick) quick=(--quick) ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
  esac
done

build_dir=build/bench
jobs="${JOBS:-2}"

echo "== machine"
echo "nproc: $(nproc)"
cpu_model="$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)"
echo "cpu: ${cpu_model:-unknown}"
echo "kernel: $(uname -sr)"
echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')$(
  git diff --quiet HEAD -- cpp CMakeLists.txt 2>/dev/null || echo ' (core sources modified)')"
echo

echo "== build (${build_dir})"
cmake -S . -B "${build_dir}" -G Ninja -DPAGEDCORE_BUILD_BENCH=ON -DPAGEDCORE_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "${build_dir}" --target bench_core -j "${jobs}"
bench_core="${build_dir}/bench/bench_core"
if [[ ! -x "${bench_core}" ]]; then
  bench_core="$(find "${build_dir}" -type f -name bench_core -perm -u+x | head -n1)"
fi
[[ -n "${bench_core}" && -x "${bench_core}" ]] || { echo "bench_core not built" >&2; exit 1; }
echo

echo "== bench_core (${bench_core})"
status=0
"${bench_core}" ${quick[@]+"${quick[@]}"} || status=$?
echo

if [[ -n "${PYTHON:-}" ]]; then
  python="${PYTHON}"
elif [[ -x "${root}/.venv/bin/python" ]]; then
  python="${root}/.venv/bin/python"
else
  python=python3
fi
echo "== bench_binding.py (${python})"
# The binding measured is the installed one, not this tree's sources: warn when
# the core changed after it was built.
so="$("${python}" -c 'import glob, os, pagedcore; print(next(iter(glob.glob(os.path.join(os.path.dirname(pagedcore.__file__), "_C*"))), ""))' 2>/dev/null || true)"
if [[ -n "${so}" ]] && [[ -n "$(find cpp CMakeLists.txt -newer "${so}" -type f 2>/dev/null | head -n1)" ]]; then
  echo "warning: ${so} is older than the core sources; reinstall it" \
       "(pip install --no-build-isolation -q .) to measure this tree" >&2
fi
"${python}" bench/bench_binding.py ${quick[@]+"${quick[@]}"} --cpp-bench "${bench_core}" || status=$?

exit "${status}"

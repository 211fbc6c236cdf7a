#!/usr/bin/env bash
# Builds and installs the pagedcore C++ core (CPU only), then builds and runs
# the example host cpp/examples against the installed CMake package.
#
#   scripts/run_host_example.sh
#   PAGEDCORE_CMAKE_ARGS="-DPAGEDCORE_DEBUG_CHECKS=ON" scripts/run_host_example.sh
#
# Everything goes under build/host-*; rerunning rebuilds only what changed.
# Set CMAKE_BUILD_PARALLEL_LEVEL to limit build jobs.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi
# Extra configure arguments for the core, split on whitespace.
extra=()
if [[ -n "${PAGEDCORE_CMAKE_ARGS:-}" ]]; then
  read -r -a extra <<<"$PAGEDCORE_CMAKE_ARGS"
fi

# A build directory configured with another generator can't be reused.
configure() {  # configure <build dir> <args...>
  local dir=$1
  shift
  if [[ -f "$dir/CMakeCache.txt" ]]; then
    local cached wanted=${generator[1]:-}
    cached=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$dir/CMakeCache.txt")
    if [[ -n "$wanted" && "$cached" != "$wanted" ]] || [[ -z "$wanted" && "$cached" == Ninja ]]; then
      echo "note: $dir was configured with '$cached', reconfiguring from scratch" >&2
      rm -rf "$dir"
    fi
  fi
  cmake "$@" -B "$dir" ${generator[@]+"${generator[@]}"}
}

echo "== configure and build the core (build/host-core)"
configure "$root/build/host-core" -S "$root" -DPAGEDCORE_CUDA=OFF ${extra[@]+"${extra[@]}"}
cmake --build "$root/build/host-core"

echo "== install the core (build/host-install)"
cmake --install "$root/build/host-core" --prefix "$root/build/host-install"

echo "== configure and build the host (build/host-example)"
configure "$root/build/host-example" -S "$root/cpp/examples" \
  -DCMAKE_PREFIX_PATH="$root/build/host-install"
cmake --build "$root/build/host-example"

echo "== run"
"$root/build/host-example/pagedcore_host"

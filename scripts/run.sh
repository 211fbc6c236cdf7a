#!/usr/bin/env bash
# The main job. Until the model runner exists: build the core, install it as a
# CMake package and run the C++ host example (the real engine driving a fake,
# deterministic model through roomy and cramped caches).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/bootstrap.sh
exec scripts/run_host_example.sh

#!/usr/bin/env bash
# Downloads the kernel benchmark's optional peer, FlashInfer 0.6.13 (and its
# apache-tvm-ffi), as wheels for the GPU machine's Python 3.12 into .peers/
# (ignored by git). The device call then carries them: `run` with
# carry=[".peers"]; bench/run_gpu.sh installs them into a scratch directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-.venv/bin/python}"
mkdir -p .peers
"$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .peers flashinfer-python==0.6.13 "apache-tvm-ffi<0.2"
ls -la .peers

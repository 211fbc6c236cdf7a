#!/usr/bin/env bash
# Downloads what `pagedcore serve` and bench/bench_serving.py need that the GPU
# machine's image lacks (fastapi, uvicorn, pydantic, the openai client and the
# versions of their dependencies they ask for; uvloop and httptools, which
# uvicorn takes when present, as `pip install uvicorn[standard]` and vLLM's
# server have them: the HTTP side's cost per streamed chunk), as wheels for its Python 3.12,
# into .gpuwheels/ (ignored by git: /.gpuwheels/ in .git/info/exclude). The
# device call carries them (`run` with carry=[".gpuwheels"]);
# bench/run_serving_gpu.sh installs them into a scratch directory.
# The versions are those the CPU tests run with.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-.venv/bin/python}"
mkdir -p .gpuwheels
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpuwheels \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 idna==3.18 h11==0.16.0 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 \
  uvloop==0.23.0 httptools==0.8.0
ls -la .gpuwheels
du -sh .gpuwheels

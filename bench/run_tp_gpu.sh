#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 (or more) GPUs, in one command: build
# pagedcore with its CUDA kernels, run test_tensor_parallel.py's cuda-marked tests
# (TP=2 greedy tokens == one GPU, with and without CUDA graphs, NCCL's all-reduces
# and torch's symmetric-memory ones; preemption, prefix caching, n > 1 and beam
# search over NCCL; a worker killed mid-run or once the last step is launched; the
# file's CPU tests are CI's), then
# bench_tp.py on the Llama-3-8B shape (random bf16 weights): batch-1 time per output
# token and throughput at 256 requests, TP=2 (each all-reduce kind of $TP_ALLREDUCE,
# default "nccl,symm_mem") against TP=1 on the same machine, the step message's
# cost (and alone, shared memory against gloo: bench_tp.py --control), the
# collectives of one decode step (captured in a CUDA graph) and the bus bandwidth
# of a large all-reduce beside the physical NVLink figure that nvidia-smi reports.
# Logs go to $OUT (or /tmp/pagedcore-tp); a summary table is printed last, with the commit
# of PAGEDCORE_COMMIT, else git's (the device's copy of .git can lag the tree it was sent:
# name the commit in the call).
#
#   bench/run_tp_gpu.sh [all|test|bench|one] [SHAPE]   (SHAPE: llama3-8b, the default, or smollm2)
#
# all (default): build, tests, benchmark. If one call's 10 minutes do not hold it all:
# `test` (build + tests), then, on the still-warm machine, `PAGEDCORE_SKIP_BUILD=1
# bench/run_tp_gpu.sh bench`. The benchmark also times TP=1 through the tensor-parallel
# path in a group of one rank (PAGEDCORE_TP_ONE_RANK=1), which separates that path's own
# cost from the collectives' between GPUs.
# one: what a machine of ONE GPU can run (build, the file's cuda-marked tests, there with
# both ranks on the one GPU or one rank alone, bench_tp.py --tp 1 --one-rank
# --collectives); no TP=2 figure.
set -uo pipefail
mode="${1:-all}"
shape="${2:-llama3-8b}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/pagedcore-tp}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# NOTE: the lent machines keep NVLink multicast off (KINDS.md); keep it so in every child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ -x /usr/bin/g++ ]]; then  # (see run_gpu.sh: the image's /opt/gcc links libstdc++ statically)
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

declare -A result
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, records pass/fail
  local name=$1
  shift
  echo "== $name"
  if "$@" >"$out/$name.log" 2>&1; then result[$name]=pass; else result[$name]="FAIL (see $name.log)"; fi
  tail -n 5 "$out/$name.log"
}

py="${PYTHON:-python3}"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
if (( gpus < 2 )) && [[ "$mode" != one ]]; then
  echo "bench/run_tp_gpu.sh needs 2 GPUs; torch sees $gpus (\`bench/run_tp_gpu.sh one\` runs what one GPU can)" >&2
  exit 2
fi
# The physical link: per-link NVLink speeds of GPU 0, summed (one direction), and the topology.
nvidia-smi topo -m >"$out/topo.txt" 2>&1
nvidia-smi nvlink --status -i 0 >"$out/nvlink.txt" 2>&1
nvlink=$(grep -o '[0-9.]* GB/s' "$out/nvlink.txt" | awk '{s += $1; n++} END {if (n) printf "%d links x %.1f GB/s = %.0f GB/s per direction", n, s / n, s}')
echo "NVLink of GPU 0: ${nvlink:-not reported (see nvlink.txt, topo.txt)}" | tee "$out/nvlink_summary.txt"

checks=()
# PAGEDCORE_SKIP_BUILD=1: a warm machine that built this tree in an earlier call.
if [[ -z "${PAGEDCORE_SKIP_BUILD:-}" ]]; then
checks+=(build)
step build env PAGEDCORE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 "$py" -m pip install -v --no-build-isolation \
  --no-deps --break-system-packages -C cmake.define.PAGEDCORE_CUDA_ARCHITECTURES=90 .
fi
if [[ "$mode" != bench ]]; then
  checks+=(pytest_tp)
  step pytest_tp "$py" -m pytest -q -p no:cacheprovider -rs -m cuda tests/python/test_tensor_parallel.py
fi
if [[ "$mode" == all || "$mode" == bench ]]; then
  checks+=(bench_tp)
  step bench_tp "$py" bench/bench_tp.py --shape "$shape" --tp 1,2 --device cuda --collectives --one-rank \
    --allreduce "${TP_ALLREDUCE:-nccl,symm_mem}"
  checks+=(bench_tp_control)  # the step message alone: shared memory against gloo
  step bench_tp_control "$py" bench/bench_tp.py --control
  echo
  tail -n 18 "$out/bench_tp.log"
  tail -n 1 "$out/bench_tp_control.log"
fi
if [[ "$mode" == one ]]; then
  checks+=(bench_tp_one_rank)
  step bench_tp_one_rank "$py" bench/bench_tp.py --shape "$shape" --tp 1 --device cuda --collectives --one-rank \
    --allreduce "${TP_ALLREDUCE:-nccl,symm_mem}"
  echo
  tail -n 8 "$out/bench_tp_one_rank.log"
fi
echo "NVLink of GPU 0: ${nvlink:-not reported}"
echo
echo "commit ${PAGEDCORE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}  GPUs: $gpus"
printf '%-14s %s\n' "check" "result"
status=0
for name in "${checks[@]}"; do
  printf '%-14s %s\n' "$name" "${result[$name]:-not run}"
  [[ "${result[$name]:-}" == pass ]] || status=1
done
exit $status

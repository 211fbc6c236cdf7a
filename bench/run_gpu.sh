#!/usr/bin/env bash
# The GPU machine's one command: build pagedcore with its CUDA kernels, run every
# Python test (the `cuda`-marked ones included), run the CUDA code under
# compute-sanitizer, and print a summary table last. Logs go to $OUT (or
# /tmp/pagedcore-gpu) so that they come back from the device.
#
#   bench/run_gpu.sh              kernels: tests, memcheck (a kernel subset; the whole
#                                 suite with PAGEDCORE_MEMCHECK_ALL=1), kernel benchmark;
#                                 with DECODE_VARIANTS (and DECODE_CASES) set, also
#                                 bench/decode_variants.py's table of them; RUN_GPU_SKIP
#                                 leaves steps out (e.g. "memcheck bench"), RUN_GPU_STEP_LIMIT
#                                 ends each step after that many seconds
#   bench/run_gpu.sh e2e SHAPE    end to end (smollm2 or llama3-8b): kernels per layer,
#                                 throughput against transformers, latency, GPU idle time
set -uo pipefail
mode="${1:-kernels}"
shape="${2:-smollm2}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/pagedcore-gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# NOTE: the device image's default compiler (/opt/gcc) links libstdc++
# statically into extension modules; a C++ exception crossing a module that
# numpy also loaded then crashes. Build with the system compiler.
if [[ -x /usr/bin/g++ ]]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

declare -A result
# RUN_GPU_SKIP="NAME ...": steps left out of this call (e.g. "memcheck bench" to fit the
# tests and DECODE_VARIANTS in one 10-minute call; "build" on a warm machine that built it).
skip=" ${RUN_GPU_SKIP:-} "
# RUN_GPU_STEP_LIMIT=S: each step ends after S seconds (timeout on the step's own command,
# so that nothing it started outlives the call's limit, as a timeout around this script
# would let its python run on beside the next command).
limit=()
[[ -n "${RUN_GPU_STEP_LIMIT:-}" ]] && limit=(timeout "$RUN_GPU_STEP_LIMIT")
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, records pass/fail
  local name=$1
  shift
  if [[ "$skip" == *" $name "* ]]; then result[$name]=skipped; echo "== $name: skipped"; return; fi
  echo "== $name"
  if ${limit[@]+"${limit[@]}"} "$@" >"$out/$name.log" 2>&1; then result[$name]=pass; else result[$name]="FAIL (see $name.log)"; fi
  tail -n 5 "$out/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
py="${PYTHON:-python3}"
# The device's Python already has torch, pybind11, scikit-build-core and pytest.
# sm_90 only here: the device is an H200 (CI builds the full list).
step build env PAGEDCORE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 "$py" -m pip install -v --no-build-isolation \
  --no-deps --break-system-packages -C cmake.define.PAGEDCORE_CUDA_ARCHITECTURES=90 .
step cuda_info "$py" -c "import pagedcore, json; print(json.dumps(pagedcore.cuda_info()))"
if compgen -G ".peers/*.whl" >/dev/null; then  # FlashInfer as a kernel peer, when carried
  step peers "$py" -m pip install --no-index --no-deps --target /tmp/pagedcore-peers .peers/*.whl
  export PYTHONPATH="/tmp/pagedcore-peers${PYTHONPATH:+:$PYTHONPATH}" FLASHINFER_CUDA_ARCH_LIST=9.0a
fi
if [[ "$mode" == e2e ]]; then
  checks=(build cuda_info e2e_kernels e2e_throughput e2e_latency e2e_overhead e2e_shared_prefix e2e_memory)
  step e2e_kernels "$py" bench/bench_e2e_gpu.py --shape "$shape" --kernels
  step e2e_throughput "$py" bench/bench_e2e_gpu.py --shape "$shape" --json "$out/e2e_$shape.json"
  step e2e_latency "$py" bench/bench_e2e_gpu.py --shape "$shape" --latency
  step e2e_overhead "$py" bench/bench_e2e_gpu.py --shape "$shape" --overhead
  step e2e_shared_prefix "$py" bench/bench_e2e_gpu.py --shape "$shape" --shared-prefix
  step e2e_memory "$py" bench/bench_memory.py --plot "$out/memory_blocks.png"
  echo
  for name in "${checks[@]:2}"; do tail -n 12 "$out/$name.log"; done
else
checks=(build cuda_info cluster_first pytest_cuda memcheck bench)
# The thread-block cluster kernels first, alone and under a time limit: a cluster
# barrier or an mbarrier that never completes hangs the GPU (no test has a timeout
# of its own). If they fail or hang, the rest of the run leaves them out.
step cluster_first timeout 240 "$py" -m pytest -q -p no:cacheprovider -m cuda tests/python -k cluster
cluster_k=" or cluster" without=()
if [[ "${result[cluster_first]}" != pass ]]; then
  cluster_k="" without=(-k "not cluster")
  echo "cluster kernels ${result[cluster_first]%% *} on their own: left out of the rest of this run"
fi
step pytest_cuda "$py" -m pytest -q -p no:cacheprovider -m cuda tests/python "${without[@]}"
if [[ -n "${PAGEDCORE_MEMCHECK_ALL:-}" ]]; then  # the whole cuda suite under memcheck (slow: a call of its own)
  # (but the test that reads kernel names from the profiler: its CUPTI takes no second subscriber)
  memcheck_k="not picks_its_kernel"
  [[ ${#without[@]} -gt 0 ]] && memcheck_k="not cluster and $memcheck_k"
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$py" -m pytest -q -p no:cacheprovider -m cuda tests/python -k "$memcheck_k"
else
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$py" -m pytest -q -p no:cacheprovider -x tests/python/test_ops_cuda.py -k "grid and bf16 and 128 or splits or swap or copy or reshape or fp8 or spare_tiles$cluster_k"
  checks+=(memcheck_layer)
  step memcheck_layer compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$py" -m pytest -q -p no:cacheprovider -x tests/python/test_layer_ops_cuda.py -k "not 4096 and not 8192 and not 14336"
fi
step bench "$py" bench/bench_kernels_gpu.py
if [[ -n "${DECODE_VARIANTS:-}" ]]; then  # the decode kernel's switches side by side (DECODE_CASES picks cases)
  checks+=(decode_variants)
  step decode_variants bash -c "cd bench && $py decode_variants.py"
fi
if [[ -n "${PAGEDCORE_NCU:-}" ]]; then  # a profile of the attention kernels (decode, then prefill)
  step ncu ncu --kernel-name regex:mma_attention --launch-skip 2 --launch-count 4 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    "$py" bench/profile_attention.py
fi
echo
[[ -f "$out/bench.log" ]] && tail -n 90 "$out/bench.log"
[[ -n "${DECODE_VARIANTS:-}" ]] && tail -n 60 "$out/decode_variants.log"
fi
echo
echo "commit ${PAGEDCORE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}  $(cat "$out/gpu.txt")"
printf '%-14s %s\n' "check" "result"
status=0
for name in "${checks[@]}"; do
  printf '%-14s %s\n' "$name" "${result[$name]:-not run}"
  [[ "${result[$name]:-}" == pass || "${result[$name]:-}" == skipped ]] || status=1
done
exit $status

#!/usr/bin/env bash
# Issue 14 on the GPU machine in one device call: build pagedcore with its CUDA
# kernels, install the carried wheels of the server and the openai client, and
# run bench/bench_serving.py for the SmolLM2 shape and the Llama-3-8B shape
# (random weights, bf16, CUDA graphs): offline LLM.generate, then the server
# (--engine-process) at 0.5x saturation and at saturation, 512 streams with a
# quarter hanging up, SIGTERM with 64 streams in flight; then, on the same
# requests, the saturation and 0.5x runs with --api-server-count N HTTP processes
# (SERVING_API_SERVERS: "4" by default for smollm2 and 2 for llama3-8b, or a
# count for all shapes, 0 to skip) and the 0.5x run at the same request rate
# with --max-num-mixed-prefill-tokens 0 (the cap off, SERVING_NOCAP=0 skips
# it); then the server with its engine as a thread (the default) at the same
# rates (SERVING_THREAD_MODE: smollm2 by default, all, or 0). Expected: build,
# then ~4 min a shape. If one call runs past its 10 minutes, run
# one shape a call: `bash bench/run_serving_gpu.sh smollm2`, then llama3-8b
# (the build directory is kept on a warm machine). Logs and JSON go to $OUT (or
# /tmp/pagedcore-serving); a table of the issue's targets is printed last.
#
# Here, once:   bench/fetch_serving_wheels.sh        (fills .gpuwheels/, ignored by git)
# On the H200:  run with carry=[".gpuwheels"]:  bash bench/run_serving_gpu.sh [smollm2 llama3-8b]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/pagedcore-serving}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
shapes=("$@")
[[ ${#shapes[@]} -eq 0 ]] && shapes=(smollm2 llama3-8b)
py="${PYTHON:-python3}"
t0=$SECONDS

# (see run_gpu.sh: the image's default compiler links libstdc++ statically)
if [[ -x /usr/bin/g++ ]]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
else
  echo "no GPU" | tee "$out/gpu.txt"
fi

# (a dry run of this script on a CPU machine: SKIP_SETUP=1 PYTHON=.venv/bin/python ... tiny)
if [[ -n "${SKIP_SETUP:-}" ]]; then
  :
elif ! compgen -G ".gpuwheels/*.whl" >/dev/null; then
  echo "no .gpuwheels/*.whl: run bench/fetch_serving_wheels.sh here and carry .gpuwheels" | tee "$out/FAILED"
  exit 1
fi
if [[ -z "${SKIP_SETUP:-}" ]]; then
  "$py" -m pip install -q --no-index --no-deps --target /tmp/pagedcore-site .gpuwheels/*.whl >"$out/wheels.log" 2>&1 \
    || { tail -20 "$out/wheels.log"; exit 1; }
  export PYTHONPATH="/tmp/pagedcore-site${PYTHONPATH:+:$PYTHONPATH}"
  "$py" -c "import fastapi, uvicorn, pydantic, openai; print('fastapi', fastapi.__version__, 'uvicorn',
uvicorn.__version__, 'pydantic', pydantic.__version__, 'openai', openai.__version__)" | tee -a "$out/wheels.log"
  # (uvicorn takes uvloop and httptools when present: bench/fetch_serving_wheels.sh fetches them)
  "$py" -c "
for name in ('uvloop', 'httptools'):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, 'missing: uvicorn runs asyncio and h11 (run bench/fetch_serving_wheels.sh again)')" | tee -a "$out/wheels.log"

  echo "== build ($((SECONDS - t0)) s)"
  if ! PAGEDCORE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 "$py" -m pip install -v --no-build-isolation --no-deps \
      --break-system-packages -C cmake.define.PAGEDCORE_CUDA_ARCHITECTURES=90 . >"$out/build.log" 2>&1; then
    tail -30 "$out/build.log"
    exit 1
  fi
  echo "built in $((SECONDS - t0)) s"
fi

source bench/serving_workload.sh
declare -A status
for shape in "${shapes[@]}"; do
  serving_workload "$shape" || { echo "unknown shape $shape"; continue; }
  common=("${base[@]}" --request-rate 0.5x inf)
  # The server with its engine in a process of its own: every check.
  echo "== $shape, --engine-process ($((SECONDS - t0)) s)"
  if "$py" bench/bench_serving.py "${common[@]}" --server-arg=--engine-process --offline \
      --disconnect-fraction 0.25 --disconnect-streams "$streams" --sigterm-streams 64 --shutdown-timeout 30 \
      --json "$out/serving_$shape.json" >"$out/serving_$shape.log" 2>&1; then
    status[$shape]=pass
  else
    status[$shape]="FAIL (see serving_$shape.log)"
  fi
  grep -v "^INFO\|^DEBUG" "$out/serving_$shape.log" | tail -n 70
  if [[ -f "$out/serving_$shape.json" ]]; then
    # Saturation with several HTTP processes (the same requests: prompt set 0, the offline figures
    # reused), then half of that saturation: one HTTP process is the bound of the SmolLM2 shape's
    # saturation, and at half of it that process is 80-90% busy (its loop's lag, not the engine,
    # is the rest of the inter-token tail at 9f29c1f).
    api="${SERVING_API_SERVERS:-$api}"
    if [[ "$api" != 0 ]]; then
      echo "== $shape, --api-server-count $api, saturation and 0.5x ($((SECONDS - t0)) s)"
      # (8 client processes: at SmolLM2's rate 4 of them would be the bottleneck, ~44 us of CPU a token)
      "$py" bench/bench_serving.py "${base[@]}" --client-processes 8 --request-rate 0.5x inf \
        --server-arg=--api-server-count="$api" \
        --offline-from "$out/serving_$shape.json" --json "$out/serving_${shape}_api$api.json" \
        >"$out/serving_${shape}_api$api.log" 2>&1 || status[${shape}_api]="FAIL (see serving_${shape}_api$api.log)"
      grep -v "^INFO\|^DEBUG" "$out/serving_${shape}_api$api.log" | tail -n 12
    fi
    # The 0.5x run again at the same rate with the mixed-prefill cap off (serve's default: 256).
    if [[ "${SERVING_NOCAP:-1}" != 0 ]]; then
      half=$("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['runs']['0.5x']['rate'])" \
             "$out/serving_$shape.json" 2>/dev/null)
      if [[ -n "$half" ]]; then
        echo "== $shape, --max-num-mixed-prefill-tokens 0 at $half req/s ($((SECONDS - t0)) s)"
        "$py" bench/bench_serving.py "${base[@]}" --request-rate "$half" --server-arg=--engine-process \
          --server-arg=--max-num-mixed-prefill-tokens=0 --json "$out/serving_${shape}_nocap.json" \
          >"$out/serving_${shape}_nocap.log" 2>&1 || status[${shape}_nocap]="FAIL (see serving_${shape}_nocap.log)"
        grep -v "^INFO\|^DEBUG" "$out/serving_${shape}_nocap.log" | grep -A3 "Inter-token\|engine steps" | tail -n 6
      fi
    fi
  fi
  # The engine as a thread of the server's process (the default): the same rates.
  thread_mode="${SERVING_THREAD_MODE:-smollm2}"  # the shapes that get it: a shape name, all or 0
  if [[ ( "$thread_mode" == all || "$thread_mode" == "$shape" ) && -f "$out/serving_$shape.json" ]]; then
    echo "== $shape, engine thread ($((SECONDS - t0)) s)"
    "$py" bench/bench_serving.py "${common[@]}" --offline-from "$out/serving_$shape.json" \
      --json "$out/serving_${shape}_thread.json" >"$out/serving_${shape}_thread.log" 2>&1 \
      || status[${shape}_thread]="FAIL (see serving_${shape}_thread.log)"
    grep -v "^INFO\|^DEBUG" "$out/serving_${shape}_thread.log" | tail -n 4
  fi
done

echo
echo "== summary ($((SECONDS - t0)) s in all)"
"$py" - "$out" "${shapes[@]}" <<'EOF'
import json, os, sys

nan = float("nan")
out, shapes = sys.argv[1], sys.argv[2:]
print(f"{'shape':<20}{'offline tok/s':>14}{'online tok/s':>13}{'ratio':>7}{'TTFT p50/p99 ms':>18}"
      f"{'ITL p50/p99 ms @0.5x':>22}{'p99/p50':>8}{'disconnect':>11}{'SIGTERM':>9}")
def verdict(s, check):
    return "-" if check not in s else "PASS" if s[check].get("pass") else "FAIL"


def runs_of(s):
    """(the inf run, the other run: 0.5x, or the one at a given rate)"""
    runs = s["runs"]
    return runs.get("inf", {}), runs.get("0.5x") or next((v for k, v in runs.items() if k != "inf"), {})


rows = [(f"{shape}", f"serving_{shape}.json") for shape in shapes]
for shape in shapes:
    rows += [(f"{shape} ({name.rsplit('_', 1)[1][:-5].replace('api', 'api x')})", name)
             for name in sorted(os.listdir(out)) if name.startswith(f"serving_{shape}_api") and name.endswith(".json")]
    rows += [(f"{shape} (no cap)", f"serving_{shape}_nocap.json")]
rows += [(f"{shape} (thread)", f"serving_{shape}_thread.json") for shape in shapes]
rows = [(shape, name) for shape, name in rows if os.path.exists(os.path.join(out, name)) or "(" not in shape]
for shape, name in rows:
    path = os.path.join(out, name)
    if not os.path.exists(path):
        print(f"{shape:<20} no result"); continue
    s = json.load(open(path))
    inf, half = runs_of(s)
    if half and "itl_p99_over_median_at_half" not in s and half.get("median_itl_ms"):
        s["itl_p99_over_median_at_half"] = half["p99_itl_ms"] / half["median_itl_ms"]
    if inf and "online_offline_ratio" not in s and s.get("offline"):
        s["online_offline_ratio"] = inf["output_throughput"] / s["offline"]["output_throughput"]
    off = s.get("offline", {}).get("output_throughput", float("nan"))
    print(f"{shape:<20}{off:>14.0f}{inf.get('output_throughput', float('nan')):>13.0f}"
          f"{s.get('online_offline_ratio', float('nan')):>7.3f}"
          f"{inf.get('median_ttft_ms', float('nan')):>10.1f}/{inf.get('p99_ttft_ms', float('nan')):<7.1f}"
          f"{half.get('median_itl_ms', float('nan')):>14.2f}/{half.get('p99_itl_ms', float('nan')):<7.2f}"
          f"{s.get('itl_p99_over_median_at_half', float('nan')):>8.2f}"
          f"{verdict(s, 'disconnect'):>11}{verdict(s, 'sigterm'):>9}")
print("targets: ratio >= 0.9; ITL p99/p50 <= 2 at 0.5x saturation; disconnect: 0 5xx, all KV blocks free, "
      "/health 200; SIGTERM: every stream drained, exit 0 within --shutdown-timeout")
print()
print(f"{'where the time goes':<20}{'run':>5}{'tok/chunk':>10}{'CPU cores: client':>18}{'http':>6}{'engine':>7}"
      f"{'decode step p50/p99 ms':>24}{'prefill step p50/p99 ms':>25}{'loop lag p50/p99 ms':>21}"
      f"{'GC gen1+2 n/ms: engine':>24}{'http':>10}")
for shape, name in rows:
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    s = json.load(open(path))
    for run, r in s["runs"].items():
        if not r or "diagnostics" not in r:
            continue
        run = run if run in ("inf", "0.5x") else "0.5x"  # (a given rate: the no-cap run's)
        d, cpu, dur = r["diagnostics"], r.get("server_cpu_s", {}), r["duration_s"]
        print(f"{shape:<20}{run:>5}{r.get('tokens_per_chunk', float('nan')):>10.2f}"
              f"{r.get('client_cpu_s', float('nan')) / dur:>18.2f}{cpu.get('http', float('nan')) / dur:>6.2f}"
              f"{cpu.get('engine', float('nan')) / dur:>7.2f}"
              f"{d['decode_step_p50_ms']:>15.2f}/{d['decode_step_p99_ms']:<8.2f}"
              f"{d['prefill_step_p50_ms']:>16.2f}/{d['prefill_step_p99_ms']:<8.2f}"
              f"{d['loop_lag_p50_ms']:>12.2f}/{d['loop_lag_p99_ms']:<8.2f}"
              + "".join(f"{d.get(f'{side}_gc1_count', nan) + d.get(f'{side}_gc2_count', nan):>{w}.0f}/"
                        f"{d.get(f'{side}_gc1_ms', nan) + d.get(f'{side}_gc2_ms', nan):<7.1f}"
                        for side, w in (("engine", 16), ("http", 2))))
EOF
for shape in "${shapes[@]}"; do
  echo "$shape: ${status[$shape]:-not run}${status[${shape}_api]:+; api servers: ${status[${shape}_api]}}${status[${shape}_nocap]:+; no cap: ${status[${shape}_nocap]}}"
done
echo "commit ${PAGEDCORE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}  $(cat "$out/gpu.txt")"

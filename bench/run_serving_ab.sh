#!/usr/bin/env bash
# Issue 14's two serving figures for two server settings, alternated, in one device
# call: bench/bench_serving.py's --api-server-count run (the SmolLM2 shape by default,
# four HTTP processes, saturation with its own offline LLM.generate, then 0.5x of that
# saturation), REPEATS times for setting A and for setting B in turn (A B, B A, ...),
# then a table of each run's online/offline ratio and ITL p99 over median at half
# load, with each setting's median. One run of 512 SmolLM2 requests varies by ~0.1 in
# the ratio and by up to ~1 in p99 / p50 (bench/RESULTS.md, the twenty-sixth
# session), so a setting is judged by several runs, never by one.
#
#   SERVING_AB_A / SERVING_AB_B   extra bench_serving.py arguments of each setting
#                                 (default: none / serve's lift defaults until the twenty-ninth session,
#                                 --mixed-prefill-lift-tokens=0 --mixed-prefill-lift-max-waiting=64);
#   SERVING_AB_C                  a third setting in the same rotation (unset: none);
#                                 an environment variable for the server goes in as
#                                 ENV:NAME=VALUE (e.g. ENV:PAGEDCORE_MIXED_GRAPHS=1024)
#   REPEATS                       runs of each setting (3)
#   SERVING_AB_REVERSE=1          the first repeat in reverse order (B A; the order turns
#                                 round each repeat)
#   SERVING_REQUESTS              requests a run (default: the shape's, as run_serving_gpu.sh)
#   SKIP_SETUP=1                  the build and the wheels are already there (a warm machine)
#
# Here, once:   bench/fetch_serving_wheels.sh
# On the H200:  run with carry=[".gpuwheels"]:  bash bench/run_serving_ab.sh [smollm2|llama3-8b]
# (~90 s a SmolLM2 run after a ~3 min build: REPEATS=3 fits one 10-minute call.)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/pagedcore-serving-ab}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
shape="${1:-smollm2}"
py="${PYTHON:-python3}"
repeats="${REPEATS:-3}"
requests="${SERVING_REQUESTS:-}"
t0=$SECONDS
if [[ -x /usr/bin/g++ ]]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
if [[ -z "${SKIP_SETUP:-}" ]]; then
  compgen -G ".gpuwheels/*.whl" >/dev/null || { echo "no .gpuwheels/*.whl: run bench/fetch_serving_wheels.sh"; exit 1; }
  "$py" -m pip install -q --no-index --no-deps --target /tmp/pagedcore-site .gpuwheels/*.whl >"$out/wheels.log" 2>&1 \
    || { tail -20 "$out/wheels.log"; exit 1; }
  PAGEDCORE_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 "$py" -m pip install -v --no-build-isolation --no-deps \
    --break-system-packages -C cmake.define.PAGEDCORE_CUDA_ARCHITECTURES=90 . >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; exit 1; }
  echo "built in $((SECONDS - t0)) s"
fi
export PYTHONPATH="/tmp/pagedcore-site${PYTHONPATH:+:$PYTHONPATH}"

source bench/serving_workload.sh
serving_workload "$shape" || { echo "unknown shape $shape"; exit 1; }
# (run_serving_gpu.sh's several-process run; 8 client processes, as there; the last
# --num-requests wins)
base+=(--client-processes 8 --request-rate 0.5x inf --server-arg=--api-server-count="$api" --offline
       ${requests:+--num-requests "$requests"})

declare -A setting=([A]="${SERVING_AB_A-}" [B]="${SERVING_AB_B---server-arg=--mixed-prefill-lift-tokens=0 --server-arg=--mixed-prefill-lift-max-waiting=64}")
names=(A B)
if [[ -n "${SERVING_AB_C:-}" ]]; then  # a third setting, in the same rotation (A B C A B C ...)
  setting[C]="$SERVING_AB_C"
  names+=(C)
fi
# The order turns round each repeat (A B, B A, A B, ...; SERVING_AB_REVERSE=1 starts with
# B A): in the twenty-ninth and thirtieth sessions' A/Bs (A first in every pair) the second
# run of every pair was ahead, whichever the setting.
reversed=("${names[@]}")
for ((j = 0; j < ${#names[@]}; j++)); do reversed[j]=${names[${#names[@]} - 1 - j]}; done
for ((i = 1; i <= repeats; i++)); do
  order=("${names[@]}")
  (( (i + ${SERVING_AB_REVERSE:-0}) % 2 == 0 )) && order=("${reversed[@]}")
  for name in "${order[@]}"; do
    args=() envs=()
    for word in ${setting[$name]}; do
      if [[ "$word" == ENV:* ]]; then envs+=("${word#ENV:}"); else args+=("$word"); fi
    done
    log="$out/${shape}_${name}_$i"
    env ${envs[@]+"${envs[@]}"} timeout 300 "$py" bench/bench_serving.py "${base[@]}" ${args[@]+"${args[@]}"} \
      --json "$log.json" >"$log.log" 2>&1
    echo "== $name run $i (${setting[$name]:-defaults}): rc=$? at $((SECONDS - t0)) s"
    grep -v "^INFO\|^DEBUG" "$log.log" | tail -n 2
  done
done

"$py" - "$out" "$shape" "$repeats" "${setting[A]}" "${setting[B]}" ${setting[C]+"${setting[C]}"} <<'EOF'
import json, os, statistics, sys

out, shape, repeats, *names = sys.argv[1:]
print(f"\n{shape}: online/offline at saturation, ITL p99 / median at 0.5x (targets >= 0.9, <= 2)")
for label, name in zip("ABC", names):
    rows = []
    for i in range(1, int(repeats) + 1):
        path = os.path.join(out, f"{shape}_{label}_{i}.json")
        if os.path.exists(path):
            d = json.load(open(path))
            half = d["runs"].get("0.5x", {})
            rows.append((d.get("online_offline_ratio"), d.get("itl_p99_over_median_at_half"),
                         half.get("median_itl_ms"), half.get("p99_itl_ms")))
    if not rows:
        print(f"  {label} ({name or 'defaults'}): no run finished")
        continue
    cells = ", ".join(f"{r:.3f} / {q:.2f} ({m:.2f} / {p:.2f} ms)" for r, q, m, p in rows if None not in (r, q, m, p))
    ok = [r for r in rows if None not in r]
    med = (f"; medians {statistics.median(r[0] for r in ok):.3f} / {statistics.median(r[1] for r in ok):.2f}"
           if ok else "")
    print(f"  {label} ({name or 'defaults'}): {cells}{med}")
EOF
echo "commit ${PAGEDCORE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}; $((SECONDS - t0)) s in all"

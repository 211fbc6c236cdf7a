"""Start-up time, each run in a fresh process: ``LLM()`` with the default model after
``import torch, transformers`` (wall and CPU time, and the time of each start-up
phase from the debug log), ``pagedcore generate`` for a few tokens end to end, and
a second ``scripts/run.sh`` (bootstrap + generate) end to end. Medians of
``--repeat`` runs (default 5), after one warm-up run of each (page cache).

    .venv/bin/python bench/bench_startup.py [--repeat 5] [--tokens 8]
    .venv/bin/python bench/bench_startup.py --source /tmp/old/python   # another checkout's sources

``--source`` runs the ``pagedcore`` package found in that directory (with the
installed extension copied next to it by the caller) instead of the editable
install, to measure a former commit the same way. The machine's load average is
printed with the results: on a shared machine it decides the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
PROMPT = "What is the capital of France?"

# Run in the child: the package from --source (bypassing the editable finder) when
# given, LLM() timed after torch and transformers are imported.
CHILD = r"""
import os, sys, time, json, logging
source = os.environ.get("BENCH_SOURCE")
if source:
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    sys.path.insert(0, source)
import torch, transformers
logging.getLogger("pagedcore").setLevel(logging.DEBUG)
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("%(message)s"))
logging.getLogger("pagedcore").addHandler(handler)
os.environ["PAGEDCORE_CONFIGURE_LOGGING"] = "0"
from pagedcore import LLM, default_model_path
default_model_path()  # converted once, before timing
wall, cpu = time.perf_counter(), time.process_time()
llm = LLM()
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
"""
PHASE = re.compile(r"start-up: (.+) in ([0-9.]+) s$")


def llm_startup(source: str | None) -> tuple[float, float, dict[str, float]]:
    env = dict(os.environ, BENCH_SOURCE=source or "")
    out = subprocess.run([PYTHON, "-c", CHILD], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    phases = {}
    for line in out.stderr.splitlines():
        m = PHASE.search(line)
        if m:
            phases[m.group(1)] = float(m.group(2))
    return result["wall"], result["cpu"], phases


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of a command, its children included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--source", default=None, help="run the pagedcore package in this directory")
    parser.add_argument("--skip-run-sh", action="store_true", help="do not time scripts/run.sh")
    args = parser.parse_args()

    generate = [PYTHON, "-m", "pagedcore", "generate", PROMPT, "--chat", "--max-tokens", str(args.tokens)]
    env = dict(os.environ)
    if args.source:  # python -m pagedcore from the given sources
        generate = [PYTHON, "-c", "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' "
                    f"not in type(f).__name__]; sys.path.insert(0, {args.source!r}); "
                    "from pagedcore.cli import main; sys.exit(main())", *generate[3:]]
    run_sh = ["scripts/run.sh", PROMPT, "--chat", "--max-tokens", str(args.tokens)]

    load_before = os.getloadavg()
    llm_startup(args.source)  # warm-up
    runs = [llm_startup(args.source) for _ in range(args.repeat)]
    # generate and run.sh alternate, so that a load changing over time affects both alike.
    with_run_sh = not args.skip_run_sh and not args.source
    timed(generate, env)
    if with_run_sh:
        timed(run_sh)
    gen: list[tuple[float, float]] = []
    run: list[tuple[float, float]] = []
    for _ in range(args.repeat):
        gen.append(timed(generate, env))
        if with_run_sh:
            run.append(timed(run_sh))
    gen_times = [w for w, _ in gen]
    run_times = [w for w, _ in run]
    load_after = os.getloadavg()

    med = statistics.median
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} on {os.cpu_count()} CPUs")
    print(f"LLM() after import torch, transformers: median wall {med(r[0] for r in runs):.2f} s "
          f"(runs {', '.join(f'{r[0]:.2f}' for r in runs)}), median CPU {med(r[1] for r in runs):.2f} s")
    names = [name for name in runs[0][2]]
    for name in names:
        values = [r[2].get(name, float("nan")) for r in runs]
        print(f"  phase {name:<24} median {med(values):.3f} s")
    print(f"pagedcore generate ({args.tokens} tokens) end to end: median {med(gen_times):.2f} s "
          f"(runs {', '.join(f'{t:.2f}' for t in gen_times)}), median CPU {med(c for _, c in gen):.2f} s")
    if run_times:
        print(f"scripts/run.sh again ({args.tokens} tokens) end to end: median {med(run_times):.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in run_times)}); "
              f"median CPU {med(c for _, c in run):.2f} s; over pagedcore generate: wall "
              f"{med(run_times) - med(gen_times):+.2f} s, CPU {med(c for _, c in run) - med(c for _, c in gen):+.2f} s")


if __name__ == "__main__":
    main()

"""Threads that share the machine: the main example alone and beside one busy process, in one run.

Runs `examples/finetune_gpt.py --steps N` (the README's main job, shortened) as a subprocess,
once alone and once while another process keeps one core busy (a pure-Python loop, pinned to
nothing, started just before and killed just after), for each mode:

- `plan`: today's default: the host thread plan owns torch's thread counts and sizes the
  pipeline thread's OpenMP team on the cores other processes leave free
  (mobius_fx/runtime/host_threads.py, `steer`);
- `today`: `MOBIUS_HOST_THREADS=steer=0`, torch's counts left as the user (here: torch's
  default, every core) set them: the behaviour before the plan owned them.
- `omp1`: `OMP_NUM_THREADS=1`, for reference (the workaround the issue measured);
- `passive`: today's counts with `OMP_WAIT_POLICY=PASSIVE` (OpenMP threads sleep at once instead
  of spinning; it must be set before torch loads OpenMP, so mobius_fx does not set it for you).

It prints each run's wall time (the whole process: start, compile, the steps, the samples),
the ratio contended / alone per mode, and plan's alone against today's alone. Runs are
interleaved (mode by mode, alone then contended) so that drift of the machine's other load
falls on every mode alike; timings are only comparable within one run of this script, on an
otherwise quiet machine.

    python benchmarks/contention.py                      # --steps 30, modes plan and today
    python benchmarks/contention.py --steps 10 --modes plan,today,omp1 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"plan": {}, "today": {"MOBIUS_HOST_THREADS": "steer=0"}, "omp1": {"OMP_NUM_THREADS": "1"},
         "passive": {"MOBIUS_HOST_THREADS": "steer=0", "OMP_WAIT_POLICY": "PASSIVE"}}
BUSY = "while True:\n    pass\n"


def run_example(steps: int, env: dict[str, str]) -> float:
    """Wall seconds of one run of the main example with `env` added to ours."""
    full = {**os.environ, **env, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("MOBIUS_HOST_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY"):  # the mode decides these, not our caller
        if k not in env:
            full.pop(k, None)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "examples" / "finetune_gpt.py"), "--steps", str(steps)], env=full,
                   cwd=REPO, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def contended(steps: int, env: dict[str, str]) -> float:
    """`run_example` beside one busy process (started first, killed after)."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.5)  # let it get going
        return run_example(steps, env)
    finally:
        busy.kill()
        busy.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps of the example (default 30)")
    ap.add_argument("--modes", default="plan,today", help=f"comma-separated, of {', '.join(MODES)} (default plan,today)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (mode, load); the median is shown")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes {args.modes!r}: unknown {bad}; choose from {', '.join(MODES)}")
    print(f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'} "
          f"in this process's affinity; load average before: {os.getloadavg()[0]:.2f}; "
          f"examples/finetune_gpt.py --steps {args.steps}", flush=True)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for m in modes:
            for load, fn in (("alone", run_example), ("contended", contended)):
                t = fn(args.steps, MODES[m])
                times.setdefault((m, load), []).append(t)
                print(f"  {m:6s} {load:9s} {t:7.1f} s", flush=True)
    print()
    print(f"{'mode':8s} {'alone':>9s} {'beside 1 busy':>14s} {'contended/alone':>16s}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for m in modes:
        a, c = med[(m, "alone")], med[(m, "contended")]
        print(f"{m:8s} {a:8.1f}s {c:13.1f}s {c / a:15.2f}x")
    if "plan" in modes and "today" in modes:
        print(f"\nplan alone / today alone: {med[('plan', 'alone')] / med[('today', 'alone')]:.2f}x; "
              f"plan contended / today contended: {med[('plan', 'contended')] / med[('today', 'contended')]:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f} (figures are noise on a machine other work shares)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

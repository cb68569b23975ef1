"""The optimizer overlap on the CPU: `examples/finetune_gpt.py` under each `--optimizer-overlap`.

Runs the example (virtual:4 GPUs on the CPU, its defaults) once per mode per round, the modes
interleaved in each round (so load from other processes falls on all of them alike), each run a
fresh process timed from start to exit, as `time python examples/finetune_gpt.py --steps N
--optimizer-overlap MODE` would. Prints every run, then per mode the best and the median wall
time and their ratios to "none" (issue 27: neither "sync" nor "async" above 1.03x "none").

    python benchmarks/overlap_cpu.py                    # 100 steps, 2 rounds
    python benchmarks/overlap_cpu.py --steps 30 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a checkout, uninstalled

from mobius_fx.kinds import OVERLAP_MODES as MODES  # noqa: E402


def run(mode: str, steps: int, extra: list[str]) -> float:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "finetune_gpt.py"), "--steps", str(steps),
           "--optimizer-overlap", mode, "--log-every", str(10 ** 9), *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("extra", nargs="*", help="more arguments for the example (after --)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    print(f"examples/finetune_gpt.py --steps {args.steps} {' '.join(args.extra)}; {args.rounds} rounds, modes "
          f"interleaved; {len(os.sched_getaffinity(0))} cores; MOBIUS_HOST_THREADS="
          f"{os.environ.get('MOBIUS_HOST_THREADS', '')!r}", flush=True)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]  # no mode always first (or last) in a round
        for m in order:
            times[m].append(run(m, args.steps, args.extra))
            print(f"round {r + 1}: {m:5s} {times[m][-1]:6.1f} s", flush=True)
    base = times.get("none")
    print(f"{'mode':5s} {'best s':>7s} {'median s':>9s} {'best/none':>10s} {'median/none':>12s}")
    for m in modes:
        best, med = min(times[m]), statistics.median(times[m])
        ratio = (f"{best / min(base):10.3f} {med / statistics.median(base):12.3f}" if base else "")
        print(f"{m:5s} {best:7.1f} {med:9.1f} {ratio}")


if __name__ == "__main__":
    main()

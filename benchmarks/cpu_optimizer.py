"""How fast a CPU optimizer steps fp32 master weights on this machine, in bytes/s.

The Mobius step ends with the optimizer over the fp32 masters in host memory; the simulator
and the CLI charge it as `bytes touched / bandwidth` (`mobius_fx.sim_tasks.TOUCHED_BYTES`:
28 B per parameter for Adam/AdamW — read the parameter, its gradient and both moments, write
the parameter and both moments). This script measures that bandwidth for torch's AdamW in its
three implementations (the per-tensor loop, `foreach`, `fused`) and for DeepSpeed's CPU Adam
when it happens to be installed (it is not a dependency), and the host-side copies around a
step with half-precision streaming (the refresh of the streamed copy, the gradient hand-over)
against it, over GPT-like tensors totalling
`--params` parameters (default 64M, 1.8 GB of state), with gradients set once. Each figure is
the median of `--steps` timed steps after one warm-up step, all variants interleaved in one run.

    python benchmarks/cpu_optimizer.py [--params 64e6] [--steps 5] [--threads N]
"""

from __future__ import annotations

import os
import sys
import argparse
import statistics
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

from mobius_fx.sim_tasks import CPU_ADAM_BANDWIDTH, HOST_COPY_SPEED, TOUCHED_BYTES


def gpt_like(total: float, hidden: int = 1024) -> list[torch.Tensor]:
    """fp32 tensors of a GPT's blocks (4h x h and h x 4h MLP, 3h x h and h x h attention, biases,
    layer norms) until `total` parameters; gradients set to small random values."""
    shapes = [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,), (4 * hidden, hidden), (4 * hidden,),
              (hidden, 4 * hidden), (hidden,), (hidden,), (hidden,), (hidden,), (hidden,)]
    per_block = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(max(1, round(total / per_block))):
        for s in shapes:
            p = torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02)
            p.grad = torch.randn(s, generator=gen) * 1e-3
            params.append(p)
    return params


def variants(params: list[torch.Tensor]) -> dict:
    out = {"AdamW (per tensor)": torch.optim.AdamW(params, lr=1e-4, foreach=False),
           "AdamW (foreach)": torch.optim.AdamW(params, lr=1e-4, foreach=True)}
    try:
        out["AdamW (fused)"] = torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, ValueError) as e:  # a torch without the fused CPU kernel
        print(f"AdamW (fused): not available in torch {torch.__version__} ({e})")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        out["DeepSpeedCPUAdam"] = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
    except Exception as e:  # noqa: BLE001 - not installed, or its C++ extension does not build here
        print(f"DeepSpeedCPUAdam: not measured ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=64e6, help="parameters to step (at least 50M for the issue)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per optimizer (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = gpt_like(args.params)
    n = sum(p.numel() for p in params)
    touched = TOUCHED_BYTES["adamw"] * n
    opts = variants(params)
    times: dict[str, list[float]] = {name: [] for name in opts}
    for name, opt in opts.items():  # warm-up: allocates the moments
        opt.step()
    for _ in range(args.steps):
        for name, opt in opts.items():  # interleaved, so machine noise hits every variant alike
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    print(f"{n / 1e6:.1f}M fp32 parameters in {len(params)} tensors, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {TOUCHED_BYTES['adamw']} B touched per parameter per step")
    best = None
    for name, ts in times.items():
        t = statistics.median(ts)
        bw = touched / t
        best = max(best or (0.0, ""), (bw, name))
        print(f"  {name:20s} {t * 1e3:8.1f} ms per step  {bw / 1e9:6.2f} GB/s  (median of {len(ts)})")
    print(f"fastest here: {best[1]} at {best[0] / 1e9:.2f} GB/s; the simulator and CLI default to "
          f"{CPU_ADAM_BANDWIDTH / 1e9:.0f} GB/s (sim_tasks.CPU_ADAM_BANDWIDTH, pass your figure as --adam-gbps)")
    copies(params, best[0], args.steps)


def copies(params: list[torch.Tensor], adam_bw: float, steps: int) -> None:
    """The host-side copies around a step with bf16-streamed weights (sim_tasks.host_copy_bytes),
    each against the fastest AdamW's bytes/s (sim_tasks.HOST_COPY_SPEED is that ratio)."""
    n = sum(p.numel() for p in params)
    kept16 = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    grads16 = [torch.randn(p.shape, dtype=torch.bfloat16) for p in params]
    kept32 = [torch.zeros(p.shape) for p in params]

    def refresh() -> None:  # the streamed copy written from the new masters
        for b, p in zip(kept16, params):
            b.copy_(p.detach())

    def fresh() -> None:  # a downloaded gradient made a new fp32 .grad (zero_grad(set_to_none=True))
        for g in grads16:
            g.to(torch.float32)

    def into() -> None:  # ... added into a kept fp32 .grad (zero_grad(set_to_none=False))
        for a, g in zip(kept32, grads16):
            a.add_(g)

    cases = {"refresh: fp32 -> kept bf16 copy": (refresh, 6), "hand-over: bf16 -> new fp32 tensor": (fresh, 6),
             "hand-over: bf16 added into kept fp32": (into, 10)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for f, _ in cases.values():
        f()
    for _ in range(steps):
        for name, (f, _) in cases.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    print(f"host copies around a bf16-streamed step (simulated at sim_tasks.HOST_COPY_SPEED = {HOST_COPY_SPEED} x the "
          f"optimizer's bytes/s):")
    for name, (_, per) in cases.items():
        bw = per * n / statistics.median(times[name])
        print(f"  {name:38s} {per:2d} B/param  {bw / 1e9:6.2f} GB/s  {bw / adam_bw:.2f}x the fastest AdamW's")


if __name__ == "__main__":
    main()

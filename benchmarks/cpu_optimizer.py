"""How fast a CPU optimizer steps fp32 master weights on this machine, in bytes/s.

The Mobius step ends with the optimizer over the fp32 masters in host memory; the simulator
and the CLI charge it as `bytes touched / bandwidth` (`mobius_fx.planning.host_step.TOUCHED_BYTES`:
28 B per parameter for Adam/AdamW — read the parameter, its gradient and both moments, write
the parameter and both moments). This script measures that bandwidth for torch's AdamW in its
three implementations (the per-tensor loop, `foreach`, `fused`) and for DeepSpeed's CPU Adam
when it happens to be installed (it is not a dependency), and the host-side copies around a
step with half-precision streaming (the refresh of the streamed copy, the gradient hand-over)
against it, over GPT-like tensors totalling
`--params` parameters (default 64M, 1.8 GB of state), with gradients set once. Each figure is
the median of `--steps` timed steps after one warm-up step, all variants interleaved in one run.

    python benchmarks/cpu_optimizer.py [--params 64e6] [--steps 5] [--threads N] [--topology-out server.json]
                                       [--sweep-params 32e6] [--sweep-threads 1,2,4] [--no-sweep]
                                       [--sweep-only] [--sweep-inductor]

Then, per thread count (1, 2, 4, ... and this process's cores), the host's ceiling beside the
optimizers over the same 28 bytes per parameter (`sweep`): a STREAM-like triad (one C++ loop,
`host_kernel.triad`, reading p, m, v in fp32 and a bf16 gradient, writing p, m, v and a bf16 copy
with the pass's stores, one multiply-add each; torch.compile's where no C++ extension builds),
torch's AdamW(fused=True) on fp32 gradients (which writes no copy), and the fused host pass
(`mobius_fx.runtime.host_optimizer`: bf16 gradient in, the streamed bf16 copy out; its backend is
printed), in GB/s, with the pass's ratio to torch's fused AdamW (the acceptance bar: >= 1.0 on a
quiet machine) and to the triad, and with `--sweep-inductor` (when the pass is the C++ kernel) the
same pass built with torch.compile (its fallback) and its ratio; each the median of `--steps` interleaved repeats, all
in one run. It ends with the JSON "host" snippet for the topology (the pass's bytes/s at the most
threads).

With `--topology-out PATH` it writes what it measured into the "host" section of the topology
JSON at PATH (`mobius_fx.topology.server.HostFigures`: the fastest torch AdamW's bytes/s and kernel,
the slowest host copy's bytes/s, the cores), keeping the rest of the file, for the simulator.
PATH must hold a topology already (`benchmarks/gpu_check.py` writes one of the machine; or your
own, see mobius_fx.topology.server).
"""

from __future__ import annotations

import os
import sys
import argparse
import statistics
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

from mobius_fx import Topology
from mobius_fx.errors import TopologyError
from mobius_fx.planning.host_step import CPU_ADAM_BANDWIDTH, HOST_COPY_BANDWIDTH, TOUCHED_BYTES
from mobius_fx.topology.schema import HostFigures


def write_host(path: str | os.PathLike, host: HostFigures) -> Topology:
    """Put `host` into the topology JSON at `path` (the rest kept) and return the topology;
    TopologyError (a MobiusError) when `path` holds no topology."""
    if not os.path.exists(path):
        raise TopologyError(f"--topology-out {str(path)!r} does not exist; the host figures go into a topology "
                            f"already written: run benchmarks/gpu_check.py on the machine (it writes OUT/topology.json) "
                            f"or describe the server in JSON (see mobius_fx.topology.server), then pass its path")
    topo = Topology.from_json(os.fspath(path)).with_host(host)
    with open(path, "w") as f:
        f.write(topo.to_json())
    return topo


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_IMPLEMENTATION = {"AdamW (per tensor)": "for-loop", "AdamW (foreach)": "foreach", "AdamW (fused)": "fused"}


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
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the GPT-like tensors (default 1024)")
    ap.add_argument("--topology-out", default=None,
                    help="a topology JSON to write the host figures into (its 'host' section; the file must exist)")
    ap.add_argument("--sweep-params", type=float, default=32e6,
                    help="parameters of the per-thread-count sweep (triad, torch fused AdamW, the fused pass)")
    ap.add_argument("--sweep-threads", default=None,
                    help="thread counts of the sweep, comma-separated (default 1, 2, 4, ... and the cores)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the per-thread-count sweep")
    ap.add_argument("--sweep-inductor", action="store_true",
                    help="the sweep also times the pass built with torch.compile (its fallback), beside the C++ one")
    ap.add_argument("--sweep-only", action="store_true", help="only the per-thread-count sweep")
    args = ap.parse_args(argv)
    if args.sweep_only:
        host = sweep(args.sweep_params, args.steps, _thread_counts(args.sweep_threads), args.hidden,
                     args.sweep_inductor)
        if args.topology_out and host is not None:
            write_host(args.topology_out, host)
            print(f"host figures written to {args.topology_out}: {host.to_dict()}")
        return
    if args.topology_out and not os.path.exists(args.topology_out):  # refused before minutes of measuring
        try:
            write_host(args.topology_out, HostFigures())
        except TopologyError as e:
            raise SystemExit(f"cpu_optimizer: {e}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    params = gpt_like(args.params, hidden=args.hidden)
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
    print(f"fastest here: {best[1]} at {best[0] / 1e9:.2f} GB/s; without a measured host section the simulator and "
          f"CLI default to {CPU_ADAM_BANDWIDTH / 1e9:.1f} GB/s (planning.host_step.CPU_ADAM_BANDWIDTH: fused AdamW measured on "
          f"the H200 run's 16-core host; --topology-out writes this machine's figures, --adam-gbps passes one)")
    speeds = copies(params, best[0], args.steps)
    passed = None
    if not args.no_sweep:
        del opts, params
        passed = sweep(args.sweep_params, args.steps, _thread_counts(args.sweep_threads), args.hidden,
                       args.sweep_inductor)
    if args.topology_out and passed is not None:
        write_host(args.topology_out, passed.__class__(**{**passed.to_dict(), "host_copy_bytes_per_s": min(speeds.values())}))
        print(f"host figures written to {args.topology_out} (the fused host pass's)")
    elif args.topology_out:
        # the user's torch optimizer, not DeepSpeed's: that is what a Mobius step runs
        bw, name = max((touched / statistics.median(ts), n) for n, ts in times.items() if n in _IMPLEMENTATION)
        host = HostFigures(optimizer="adamw", implementation=_IMPLEMENTATION[name], optimizer_bytes_per_s=bw,
                           host_copy_bytes_per_s=min(speeds.values()), cores=cores())
        write_host(args.topology_out, host)
        print(f"host figures written to {args.topology_out}: {host.to_dict()}")


def copies(params: list[torch.Tensor], adam_bw: float, steps: int) -> dict[str, float]:
    """The host-side copies around a step with bf16-streamed weights (planning.host_step.host_copy_bytes),
    each against the fastest AdamW's bytes/s; returns each one's bytes/s (read + written). The
    simulator charges them at the host section's `host_copy_bytes_per_s` (the slowest of these),
    else planning.host_step.HOST_COPY_BANDWIDTH."""
    speeds = copy_speeds(params, steps)
    print(f"host copies around a bf16-streamed step (without a measured host section the simulator charges them at "
          f"{HOST_COPY_BANDWIDTH / 1e9:.1f} GB/s, planning.host_step.HOST_COPY_BANDWIDTH, the H200 host's hand-over):")
    for name, bw in speeds.items():
        print(f"  {name:38s} {_COPY_BYTES[name]:2d} B/param  {bw / 1e9:6.2f} GB/s  {bw / adam_bw:.2f}x the fastest "
              f"AdamW's")
    return speeds


_COPY_BYTES = {"refresh: fp32 -> kept bf16 copy": 6, "hand-over: bf16 -> new fp32 tensor": 6,
               "hand-over: bf16 added into kept fp32": 10}


def copy_speeds(params: list[torch.Tensor], steps: int) -> dict[str, float]:
    """Bytes/s (read + written, `_COPY_BYTES` a parameter) of each host copy around a step with
    bf16-streamed weights: median of `steps` after one warm-up."""
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

    cases = dict(zip(_COPY_BYTES, (refresh, fresh, into)))
    times: dict[str, list[float]] = {k: [] for k in cases}
    for f in cases.values():
        f()
    for _ in range(steps):
        for name, f in cases.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: _COPY_BYTES[name] * n / statistics.median(times[name]) for name in cases}


def _thread_counts(spec: str | None) -> list[int]:
    if spec:
        return [int(t) for t in spec.split(",") if t.strip()]
    n, out, t = cores(), [], 1
    while t < n:
        out.append(t)
        t *= 2
    return out + [n]


def sweep(total: float, steps: int, threads: list[int], hidden: int = 1024,
          with_inductor: bool = False) -> HostFigures | None:
    """Per thread count: the triad, torch's AdamW(fused=True) on fp32 gradients and the fused
    host pass over the same GPT-like tensors (`total` parameters), in bytes/s of 28 B/param;
    prints a table and the topology's "host" JSON snippet; returns the pass's HostFigures at the
    most threads (None where the pass could not be compiled). `with_inductor`: also the same pass
    built with torch.compile (the fallback), beside it."""
    import json

    from mobius_fx.runtime import host_optimizer as H

    params = gpt_like(total, hidden=hidden)
    n = sum(p.numel() for p in params)
    touched = TOUCHED_BYTES["adamw"] * n
    torch_opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    torch_opt.step()  # makes its state
    gen = torch.Generator().manual_seed(1)
    ours = [p.detach().clone() for p in params]
    grads16 = [(torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16) for p in params]
    copies16 = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    states = [{"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(1.0)}
              for p in ours]
    group = dict(torch_opt.param_groups[0])
    flat = [(p.view(-1), g.view(-1), {k: (v.view(-1) if v.dim() else v) for k, v in st.items()}, c.view(-1))
            for p, g, st, c in zip(ours, grads16, states, copies16)]

    def our_pass() -> None:
        step = float(states[0]["step"]) + 1
        for st in states:
            st["step"] += 1
        for p, g, st, c in flat:
            H.step_span("adamw", group, p, g, st, step=step, copy_out=c)

    def _triad(p, g16, m, v, out, a):  # the same bytes as the pass, one multiply-add per tensor
        g = g16.float()
        p2 = p + a * g
        p.copy_(p2)
        m.copy_(m + a * g)
        v.copy_(v + a * g)
        out.copy_(p2)

    tri = [(p.view(-1), g.view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1), c.view(-1))
           for p, g, st, c in zip(ours, grads16, states, copies16)]
    try:  # the triad in C++, with the pass's stores (host_kernel.triad); else the same in torch.compile
        kernel = H.host_kernel.load()
        triad_kind = "C++"

        def triad() -> None:
            for t in tri:
                kernel.triad(*t, 1e-9)
    except Exception as e:  # noqa: BLE001 - no C++ toolchain: the compiled one (inductor also needs one)
        print(f"the C++ triad cannot be built here ({type(e).__name__}); the triad is torch.compile's")
        triad_k = torch.compile(_triad, dynamic=True, fullgraph=True)
        a = torch.tensor(1e-9)
        triad_kind = "inductor"

        def triad() -> None:
            for t in tri:
                triad_k(*t, a)

    def inductor_pass() -> None:  # the same pass built with torch.compile (the fallback), for comparison
        keep = H.BACKENDS
        H.BACKENDS = ("inductor",)
        try:
            our_pass()
        finally:
            H.BACKENDS = keep

    our_pass()  # builds the kernel (first use): which one it is shows after
    kind = H.backend()
    cases = {"triad": triad, "torch AdamW(fused=True), fp32 grad": torch_opt.step,
             "fused pass, bf16 grad + copy": our_pass}
    if kind == "c++" and with_inductor:
        cases["inductor pass"] = inductor_pass
    print(f"\nper thread count, {n / 1e6:.1f}M parameters, {TOUCHED_BYTES['adamw']} B/param (GB/s, median of {steps} "
          f"interleaved; ratio = fused pass / torch fused; the pass: {kind}, the triad: {triad_kind}):")
    print(f"{'threads':>8s}{'triad':>10s}{'torch fused':>13s}{'fused pass':>12s}{'ratio':>8s}{'pass/triad':>12s}"
          + (f"{'inductor pass':>15s}{'ratio':>8s}" if "inductor pass" in cases else ""))
    default = torch.get_num_threads()
    rows = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for f in cases.values():  # warm-up (and compile) at this thread count
                f()
            times: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(steps):
                for k, f in cases.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            bw = {k: touched / statistics.median(v) for k, v in times.items()}
            tb, ob, pb = bw["triad"], bw["torch AdamW(fused=True), fp32 grad"], bw["fused pass, bf16 grad + copy"]
            rows.append((t, tb, ob, pb))
            ib = bw.get("inductor pass")
            print(f"{t:>8d}{tb / 1e9:>10.2f}{ob / 1e9:>13.2f}{pb / 1e9:>12.2f}{pb / ob:>8.2f}{pb / tb:>12.2f}"
                  + (f"{ib / 1e9:>15.2f}{ib / ob:>8.2f}" if ib else ""), flush=True)
    finally:
        torch.set_num_threads(default)
    if "inductor pass" in cases and "inductor" in H.reasons():
        print(f"(the inductor pass ran in eager ops: it could not be built here: {H.reasons()['inductor']})")
    if not H.compiled():
        print(f"the fused pass ran in eager ops: it could not be compiled here ({H.reason_not_compiled()})")
        return None
    t, tb, ob, pb = rows[-1]
    host = HostFigures(optimizer="adamw", implementation="mobius-host-pass", optimizer_bytes_per_s=round(pb, -6),
                       cores=cores())
    print("topology 'host' section (the fused pass at the most threads; triad %.3g B/s, torch fused AdamW %.3g B/s "
          "at %d threads):" % (tb, ob, t))
    print(json.dumps({"host": host.to_dict()}))
    return host


if __name__ == "__main__":
    main()

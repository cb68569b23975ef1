"""The baselines the simulator compares Mobius with, on the plan's own costs and the same
engine: GPipe (everything resident), ZeRO-3 offload (every GPU fetches every layer) and a
RoundPipe-style round-robin dispatch. Each builder's docstring says where its model comes from.

    simulate(plan, schedule="zero3-offload")   # mobius_fx.simulator dispatches to these
"""

from __future__ import annotations

from .errors import PlanError
from .network import Task
from .plans import MemoryModel, Plan
from .sim_tasks import STATE_BYTES, TOUCHED_BYTES, Context, Costs, Slot, cpu_optimizer, looped_pipeline
from .units import fmt_bytes

__all__ = ["roundpipe", "gpipe", "zero3_offload"]

def roundpipe(ctx: Context) -> None:
    """RoundPipe-style stateless round-robin dispatch (Luo et al., arXiv 2604.27085, 2026).

    Slot i goes to GPU (g0 + i) mod N (g0 = 0, GPUs by CUDA index); every slot runs all
    micro-batches; backward slots continue the rotation after the forward ones, so no GPU waits
    at the forward/backward turn. The last stage is RoundPipe's fused first backward slot: its
    forward doubles as the recompute (it costs b_{S-1} per micro-batch, uploads once, computes
    the loss on the GPU and keeps its input). Every other slot uploads its weights (prefetched
    while the previous slot on that GPU runs, two resident at most), saved inputs go to DRAM
    and come back, gradients go to DRAM. Simplifications: the plan's stages are the slots
    (RoundPipe also cuts backward slots ~1/3 the size of forward ones), its priority packing of
    transfers is the stream priority here, and its optimizer steps as `simulate`'s
    `optimizer_overlap` says ("async" is RoundPipe's own asynchronous optimizer).
    """
    s, n = ctx.plan.num_stages, len(ctx.gpus)
    slots = [Slot("forward", k, ctx.gpus[k % n]) for k in range(s - 1)]
    slots.append(Slot("fused", s - 1, ctx.gpus[(s - 1) % n]))
    slots += [Slot("backward", k, ctx.gpus[(2 * s - 2 - k) % n]) for k in reversed(range(s - 1))]
    looped_pipeline(ctx, ctx.stages, slots, ctx.plan.microbatches, loss_on_host=False)
    cpu_optimizer(ctx, sum(ctx.stages.master), per_stage={k: m for k, m in enumerate(ctx.stages.master) if m})


def gpipe(ctx: Context) -> None:
    """GPipe (Huang et al., 2019; torchgpipe) with every weight resident: the plan's layers
    re-cut into N stages balanced by compute, stage j on the j-th GPU, all forwards then all
    backwards (with recompute), activations hop between GPUs, no weight traffic. The
    optimizer runs on the GPUs, as GPipe does: each GPU steps its own stage at its memory
    bandwidth after the backward. Raises PlanError when a stage's weights, gradients,
    optimizer state and activations do not fit its GPU."""
    plan, n, m = ctx.plan, len(ctx.gpus), ctx.plan.microbatches
    u = _units(ctx)
    groups = _balanced(u, n)
    c = Costs([], [], [], [], [], [], [], [])
    for j, (a, z) in enumerate(groups):
        for lst, src in ((c.f, u.f), (c.b, u.b), (c.w, u.w), (c.g, u.g), (c.master, u.master)):
            lst.append(sum(src[a:z]))
        c.inp.append(u.inp[a])
        c.out.append(u.out[z - 1])
        c.names.append(f"g{j}")
    mm, recompute, work = _gpipe_memory(plan, u)
    caps = {s.gpu: s.capacity for s in plan.stages}
    by_name = {g.name: g for g in ctx.topo.gpus}
    states = STATE_BYTES[ctx.optimizer] + (4 if ctx.scale != 1.0 else 0)  # + fp32 master copy when streaming half
    for j, (a, z) in enumerate(groups):
        gpu = ctx.gpus[j]
        cap = caps.get(gpu, by_name[gpu].memory)
        opt = c.master[j] / 4.0 * states
        act = m * (c.inp[j] + c.out[j])
        need = mm.footprint(c.w[j], c.g[j], sum(recompute[a:z]), act, max(work[a:z], default=0.0))[1] + opt
        rest = need - opt - c.w[j] - c.g[j]  # activations, recompute, working memory, a micro-batch's fresh grads
        if need > cap:
            raise PlanError(
                f"gpipe stage {j} ({u.names[a]} .. {u.names[z - 1]}) on {gpu} needs {fmt_bytes(need)} (weights "
                f"{fmt_bytes(c.w[j])} + grads {fmt_bytes(c.g[j])} + {ctx.optimizer} state {fmt_bytes(opt)} + "
                f"activations, recompute and working memory {fmt_bytes(rest)}) but {gpu} has {fmt_bytes(cap)}; GPipe keeps every "
                f"weight resident, so this model does not fit {n} GPU(s): use the 'mobius' schedule or more GPUs")
    slots = [Slot("forward", j, ctx.gpus[j]) for j in range(len(groups))]
    slots += [Slot("backward", j, ctx.gpus[j]) for j in reversed(range(len(groups)))]
    looped_pipeline(ctx, c, slots, m, resident=True, offload_activations=False, grads_to_host=False)
    barrier = ctx.mark("backward done", list(range(len(ctx.tasks))), kind="barrier")
    for j in range(len(groups)):
        gpu = ctx.gpus[j]
        t = c.master[j] / 4.0 * TOUCHED_BYTES[ctx.optimizer] / by_name[gpu].spec.memory_bandwidth
        ctx.add(Task(f"optimizer {gpu}", f"{gpu}/optimizer", (), t, after=[barrier],
                     meta={"kind": "optimizer", "phase": "step", "gpu": gpu}))


def zero3_offload(ctx: Context) -> None:
    """DeepSpeed ZeRO-3 with CPU offload (ZeRO-Offload/ZeRO-Infinity, Rajbhandari et al.
    SC'21; Ren et al. ATC'21), data parallel: each GPU runs 1/N of the batch through every
    layer, fetching each layer's weights from DRAM in forward and again in backward (one layer
    prefetched ahead, as DeepSpeed's prefetch does), and sends each layer's gradients to DRAM;
    DeepSpeed's own CPU Adam (DeepSpeedCPUAdam) runs after the last one, at
    `ctx.deepspeed_adam_bw`: the Mobius optimizer's speed unless DeepSpeed's was measured on the
    machine (the topology's host section with implementation "deepspeed") or given
    (`simulate(deepspeed_adam_bandwidth=)`). Its kernel writes the fp16 copy of the weights as
    it steps (those bytes count in the step), so nothing is staged before the uploads; the
    gradients it steps are made fp32 on the host first (the "handover" host copy).
    All N GPUs fetch the same bytes, so shared switch uplinks and root complexes carry N x
    the traffic.

    The collectives as DeepSpeed runs them: a layer's all-gather gives each GPU the whole
    layer (the H2D upload), and its reduce-scatter sends each GPU's whole gradient out (the
    D2H download). On GPUs without peer-to-peer (`topology.p2p` False: GeForce cards) NCCL
    routes both through host memory, so each GPU also sends its share of the ring to the host
    with every all-gather ((N-1)/N of the layer, D2H) and receives it with every
    reduce-scatter ((N-1)/N of the gradient, H2D): `looped_pipeline(host_collectives=...)`.
    With peer-to-peer (or NVLink) that half goes GPU to GPU and is not modelled. Each rank
    keeps its own partition in host memory (`sharded`: on its socket under masters="local").
    Simplifications: one pass per GPU (no gradient accumulation), no activation traffic, the
    last layer stays resident across the turn, the reduction and NCCL's ring hops across the
    inter-socket link are free, NCCL's host buffers are on each GPU's own socket."""
    n = len(ctx.gpus)
    u = _units(ctx)
    m = ctx.plan.microbatches
    c = Costs([f * m / n for f in u.f], [b * m / n for b in u.b], u.w, u.g, u.inp, u.out, u.master, u.names)
    routed = 0.0 if ctx.topo.p2p or n == 1 else (n - 1) / n
    for gpu in ctx.gpus:
        slots = [Slot("forward", k, gpu) for k in range(len(u.f))]
        slots += [Slot("backward", k, gpu) for k in reversed(range(len(u.f)))]
        ctx.staging = False  # DeepSpeed's CPU Adam wrote the fp16 copy the uploads read
        looped_pipeline(ctx, c, slots, 1, offload_activations=False, activations=False, sharded=True,
                        host_collectives=routed)
    # DeepSpeed steps after the step, writing the fp16 copy in its kernel
    cpu_optimizer(ctx, sum(u.master), ctx.deepspeed_adam_bw, overlap="none", fused_refresh=True)


def _units(ctx: Context) -> Costs:
    """Per-layer costs (per micro-batch, streamed bytes) scaled so each stage's layers sum to
    the stage's own numbers; the stages themselves when the plan has no layer table."""
    plan = ctx.plan
    by_name = {l.name: l for l in plan.layers}
    if not plan.layers or any(n not in by_name for s in plan.stages for n in s.layers):
        return ctx.stages
    c = Costs([], [], [], [], [], [], [], [])
    m = plan.microbatches
    for s in plan.stages:
        ls = [by_name[n] for n in s.layers]

        def share(total: float, parts: list[float]) -> list[float]:
            tot = sum(parts)
            return [total * x / tot for x in parts] if tot > 0 else [total / len(parts)] * len(parts)

        c.f += share(s.fwd_time, [l.fwd_time for l in ls])
        c.b += share(s.bwd_time, [l.bwd_time for l in ls])
        c.w += share(s.param_bytes, [l.param_bytes for l in ls])
        gs = share(s.grad_bytes, [l.grad_bytes for l in ls])
        c.g += gs
        c.master += [g / ctx.scale for g in gs]
        outs = [l.output_bytes * ctx.scale / m for l in ls[:-1]] + [float(s.output_bytes)]
        c.inp += [float(s.input_bytes)] + outs[:-1]
        c.out += outs
        c.names += [l.name for l in ls]
    return c


def _balanced(u: Costs, n: int) -> list[tuple[int, int]]:
    """Contiguous groups of units, at most n, minimising the largest compute (f + b)."""
    cost = [f + b for f, b in zip(u.f, u.b)]
    size = len(cost)
    if size <= n:
        return [(i, i + 1) for i in range(size)]

    def cut(limit: float) -> list[tuple[int, int]] | None:
        groups, a, acc = [], 0, 0.0
        for i, x in enumerate(cost):
            if acc + x > limit and i > a:
                groups.append((a, i))
                a, acc = i, 0.0
            acc += x
        groups.append((a, size))
        return groups if len(groups) <= n else None

    lo, hi = max(cost), sum(cost)
    for _ in range(60):
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    return cut(hi) or [(0, size)]


def _gpipe_memory(plan: Plan, u: Costs) -> tuple[MemoryModel, list[float], list[float]]:
    """The plan's memory model (`MemoryModel.footprint`, as the partitioner uses), each
    unit's recompute bytes and its working memory (`MemoryModel.working`; a group's is the
    largest of its units'): from the layer table, or, when the units are the plan's stages,
    what of a stage's backward peak the footprint's other terms leave (working memory 0, in it)."""
    m, mm = plan.microbatches, plan.memory
    by_name = {l.name: l for l in plan.layers}
    if plan.layers and all(n in by_name for n in u.names):
        return (mm, [mm.recompute_bytes(by_name[n]) for n in u.names],
                [mm.working(by_name[n]) for n in u.names])
    rest = [max(0.0, s.peak_bytes - mm.footprint(s.param_bytes, s.grad_bytes, 0.0,
                                                  m * (s.input_bytes + s.output_bytes), 0.0)[1])
            for s in plan.stages]
    return mm, rest, [0.0] * len(rest)

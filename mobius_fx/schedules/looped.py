"""The looped pipeline the baselines (GPipe, ZeRO-3 offload, RoundPipe) are built from: slots,
each all micro-batches of one stage on one GPU, turned into simulator tasks.

    looped_pipeline(ctx, ctx.stages, [Slot("forward", 0, "gpu0"), Slot("backward", 0, "gpu0")], m)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mobius_fx.kinds import HOST
from mobius_fx.sim.tasks import Context, Costs

__all__ = ["Slot", "looped_pipeline"]


@dataclass
class Slot:
    phase: str  # forward | backward | fused
    stage: int
    gpu: str



def looped_pipeline(ctx: Context, c: Costs, slots: list[Slot], m: int, *, resident: bool = False,
              offload_activations: bool = True, activations: bool = True, loss_on_host: bool = True,
              grads_to_host: bool = True, sharded: bool = False, host_collectives: float = 0.0) -> None:
    """Tasks of a looped pipeline (the baselines): each slot runs all `m` micro-batches of one
    stage on a GPU.

    Per GPU the slots run in list order on its compute stream. A slot's weights upload on the
    GPU's upload stream when the previous slot on that GPU starts, and not before the stage two
    back on that GPU is evicted (at most two resident); a slot that follows the same stage on
    the same GPU reuses its weights. Activations arrive on the receiving GPU's activation
    stream; saved boundary inputs go to DRAM after they arrive and come back (upload stream,
    after the weights) for backward; gradients go to DRAM on the download stream after the last
    micro-batch.

    On shared links a transfer ranks by the slot that needs it (its list position; saved inputs
    by their backward slot, gradients last). Host memory is placed by `ctx.home` per stage, or
    per (GPU, stage) with `sharded` (each data-parallel rank its own partition).
    `host_collectives` = f adds the host-routed half of ZeRO-3's collectives (GPUs without
    peer-to-peer, NCCL through host memory): with each upload of w bytes (the all-gather's
    receive side) the GPU sends f x w to host memory (its all-gather send), on its "allgather"
    stream, and the slot waits for both; with each gradient download of g bytes (the
    reduce-scatter's send side) it receives f x g from host memory, on its "reduce-scatter"
    stream. For a ring over N GPUs, f = (N-1)/N.
    """
    seq: dict[str, list[int]] = defaultdict(list)
    for j, s in enumerate(slots):
        seq[s.gpu].append(j)
    pos = {j: p for js in seq.values() for p, j in enumerate(js)}
    last_stage = max(s.stage for s in slots)
    bslot = {s.stage: j for j, s in enumerate(slots) if s.phase != "forward"}  # when a saved input is needed
    done = len(slots)  # gradients: needed by the optimizer, after every slot
    comp: dict[tuple[str, int], list[int]] = {}  # (phase, stage) -> compute task per micro-batch
    where: dict[tuple[str, int], str] = {}
    arrive: dict[tuple[int, int], int | None] = {}  # (stage, mb) -> forward input arrival
    save: dict[tuple[int, int], int | None] = {}
    out: dict[int, int | None] = {}
    evict: dict[int, int | None] = {}
    for j, s in enumerate(slots):
        k, gpu, p = s.stage, s.gpu, pos[j]
        mine = seq[gpu]
        prev = slots[mine[p - 1]] if p > 0 else None
        nxt = slots[mine[p + 1]] if p + 1 < len(mine) else None
        reuse = resident or (prev is not None and prev.stage == k)
        fwd = s.phase in ("forward", "fused")
        phase = "forward" if s.phase == "forward" else "backward"
        tag = f"{s.phase[0]}{c.names[k]}"
        home = ctx.home((gpu, k) if sharded else k, gpu)
        trigger_start = [comp[(prev.phase, prev.stage)][0]] if prev is not None else []
        memory = [next((evict[q] for q in reversed(mine[:max(0, p - 1)]) if evict.get(q) is not None), None)]
        up = None
        if not reuse:
            staged = ctx.stage_copy(gpu, k, c.master[k], trigger_start) if c.w[k] > 0 else None
            up = ctx.move(f"{gpu}/upload", (p, 0, 0), HOST, gpu, c.w[k], f"prefetch {tag}",
                          after=memory + [staged], after_start=trigger_start, need=(j,), home=home,
                          kind="prefetch", phase=phase, gpu=gpu, stage=k)
        gather = None
        if up is not None and host_collectives > 0:
            gather = ctx.move(f"{gpu}/allgather", (p,), gpu, HOST, host_collectives * c.w[k], f"all-gather send {tag}",
                              after_start=[up], need=(j,), kind="collective", phase=phase, gpu=gpu, stage=k)
        rows = []
        for i in range(m):
            deps: list[int | None] = [up, gather]
            if fwd and activations:
                if k == 0:
                    src, made = HOST, None
                else:
                    src = where[("forward", k - 1)]
                    made = comp[("forward", k - 1)][i]
                a = None
                if src != gpu:
                    a = ctx.move(f"{gpu}/activation", (p, i), src, gpu, c.inp[k], f"act {tag} mb{i}", after=[made],
                                 need=(j,), home=home if src == HOST else None,
                                 kind="activation", phase="forward", gpu=gpu, stage=k, microbatch=i)
                arrive[(k, i)] = a if a is not None else made
                deps.append(arrive[(k, i)])
                if offload_activations and k > 0 and s.phase == "forward":
                    save[(k, i)] = ctx.move(f"{gpu}/download", (p, i, 0), gpu, HOST, c.inp[k],
                                            f"save {tag} mb{i}", after=[arrive[(k, i)]], kind="activation",
                                            need=(bslot.get(k, done),), home=home,
                                            phase="forward", gpu=gpu, stage=k, microbatch=i)
            if s.phase == "backward" and activations:
                if offload_activations and k > 0 and (k, i) in save:
                    deps.append(ctx.move(f"{gpu}/upload", (p, 1, i), HOST, gpu, c.inp[k], f"restore {tag} mb{i}",
                                         after=[save[(k, i)], *memory], after_start=trigger_start,
                                         need=(j,), home=home,
                                         kind="activation", phase="backward", gpu=gpu, stage=k, microbatch=i))
                elif offload_activations and k == 0 and c.inp[0] > 0:  # the model input, sent again from the host
                    deps.append(ctx.move(f"{gpu}/upload", (p, 1, i), HOST, gpu, c.inp[0], f"input {tag} mb{i}",
                                         after=memory, after_start=trigger_start, need=(j,), home=home,
                                         kind="activation", phase="backward", gpu=gpu, stage=k, microbatch=i))
                if k == last_stage:
                    src, made = HOST, out.get(i) if out.get(i) is not None else comp[("forward", k)][i]
                else:
                    nb = ("backward", k + 1) if ("backward", k + 1) in comp else ("fused", k + 1)
                    src, made = where[nb], comp[nb][i]
                hop = None
                if src != gpu and (src != HOST or loss_on_host):
                    hop = ctx.move(f"{gpu}/activation", (p, i), src, gpu, c.out[k], f"grad-in {tag} mb{i}",
                                   after=[made], need=(j,), home=home if src == HOST else None,
                                   kind="activation", phase="backward", gpu=gpu, stage=k, microbatch=i)
                deps.append(hop if hop is not None else made)
            dur = c.f[k] if s.phase == "forward" else c.b[k]
            ci = ctx.compute(gpu, dur, f"{tag} mb{i}", deps, phase=phase, stage=k, microbatch=i)
            rows.append(ci)
            if s.phase == "forward" and k == last_stage and activations and loss_on_host:
                out[i] = ctx.move(f"{gpu}/download", (p, i, 1), gpu, HOST, c.out[k], f"output mb{i}", after=[ci],
                                  need=(bslot.get(k, done),), home=home,
                                  kind="activation", phase="forward", gpu=gpu, stage=k, microbatch=i)
        comp[(s.phase, k)] = rows
        where[(s.phase, k)] = gpu
        if s.phase != "forward" and grads_to_host:
            ctx.move(f"{gpu}/download", (p, m, 0), gpu, HOST, c.g[k], f"grad {tag}", after=[rows[-1]],
                     need=(done,), home=home, kind="gradient", phase="backward", gpu=gpu, stage=k)
            if host_collectives > 0:
                ctx.move(f"{gpu}/reduce-scatter", (p,), HOST, gpu, host_collectives * c.g[k],
                         f"reduce-scatter receive {tag}", after=[rows[-1]], need=(done,),
                         kind="collective", phase="backward", gpu=gpu, stage=k)
        if not resident and not (nxt is not None and nxt.stage == k):
            evict[j] = ctx.mark(f"evict {tag}", [rows[-1]], kind="evict", phase=phase, gpu=gpu, stage=k)


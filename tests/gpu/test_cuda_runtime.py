"""The CUDA device layer: the same pipeline as on virtual GPUs, on real streams (skipped without CUDA).

Several pipeline GPUs may share one CUDA device: each pipeline GPU name gets its own compute,
upload and download streams (`CudaDevice`), and an activation sent between two names on one
device is a copy on the receiver's compute stream ordered after the sender's by
`wait_stream` / `record_stream`. So a single GPU exercises every stream and event path except
the device-to-device copy itself; the tests that claim that path ("cross-device") are skipped
with fewer than two CUDA devices.
"""

import copy
import gc

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from mobius_fx import MobiusError, trace
from mobius_fx.runtime.memory_sources import CudaAllocator
from mobius_fx.runtime.device_cuda import CudaDevice
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import ResidualMLP, hf_gpt2, hf_inputs, nanogpt, nanogpt_inputs

try:
    from tests.models import BF16_UNIT_ROUNDOFF, bf16_roundings
except ImportError:  # pragma: no cover
    from models import BF16_UNIT_ROUNDOFF, bf16_roundings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_COMPUTE = ("call_function", "call_method", "call_module")
LAYOUTS = ["one-device", "cross-device"]  # GPU names all on cuda:0 / spread over the CUDA devices


def needs_devices_for(layout: str) -> None:
    if layout == "cross-device" and torch.cuda.device_count() < 2:
        pytest.skip(f"cross-device copies need 2 CUDA devices, this machine has {torch.cuda.device_count()}; the "
                    f"one-device variant covers the streams")


def even_cut(gm, stages):
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def cuda_pipeline(model, inputs, kwargs=None, *, stages=4, gpus=2, microbatches=2, gm=None, one_device=False, **kw):
    """Stage k on pipeline GPU gpu{k % gpus}; with `one_device` every name on cuda:0, else the
    names spread over the CUDA devices (on a one-GPU machine that is cuda:0 as well)."""
    gm = gm if gm is not None else trace(model, example_inputs=inputs, example_kwargs=kwargs)
    indices = {f"gpu{i}": 0 if one_device else i % torch.cuda.device_count() for i in range(gpus)}
    return build_pipeline(model, gm, stage_nodes=even_cut(gm, stages),
                          stage_gpus=[f"gpu{k % gpus}" for k in range(stages)], gpu_budgets={},
                          microbatches=microbatches, example_inputs=inputs, example_kwargs=kwargs, device="cuda",
                          gpu_indices=indices, **kw)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def graph_values(gm, *mb_inputs):
    """Each value of `gm` as a meta tensor of its shape for one micro-batch (ShapeProp): what
    `pipe.schedule_ir` sizes activation copies with."""
    ShapeProp(gm).propagate(*mb_inputs)
    return {n.name: torch.empty(tm.shape, dtype=tm.dtype, device="meta") for n in gm.graph.nodes
            if hasattr(tm := n.meta.get("tensor_meta"), "shape")}


def assert_activations_crossed(pipe, layout, gm, mb_inputs):
    """Every stage hop went between two pipeline GPUs, as a same-device copy between two names'
    streams or (cross-device) between two CUDA devices, exactly as the schedule IR counts them:
    each value pushed to the next stage in forward and its gradient sent back in backward, per
    micro-batch, same copies and bytes per GPU and stage."""
    ir = pipe.schedule_ir(graph_values(gm, *mb_inputs))
    want = {(gpu, stage): (count, nbytes) for (gpu, what, direction, stage), (count, nbytes)
            in ir.bytes_moved().items() if (what, direction) == ("activation", "d2d")}
    got = {(gpu, stage): (c["count"], c["bytes"]) for gpu, kinds in pipe.transfer_stats(last_step=True,
                                                                                        by_stage=True).items()
           for stage, c in kinds.get("activation d2d", {}).items()}
    assert want and got == want
    stages = pipe.schedule.stages
    # the IR's forward hops: one per value a stage pushes to the next one on another GPU, per micro-batch
    pushed = sum(ref.stage == st.index - 1 for st in stages[1:] if stages[st.index - 1].gpu != st.gpu
                 for ref in st.inputs)
    forward = sum(o.direction == "d2d" and o.phase == "forward" for o in ir.copies())
    assert pushed and forward == pushed * pipe.schedule.microbatches
    devices = {pipe.devices[st.gpu].torch_device for st in stages}
    assert len(devices) == (1 if layout == "one-device" else min(torch.cuda.device_count(), len(pipe.devices)))
    streams = [pipe.devices[name].compute_stream for name in pipe.devices]
    assert len(set(streams)) == len(streams)  # each name computes (and receives) on its own stream


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("microbatches", [1, 4])
def test_cuda_pipeline_matches_cpu_eager(microbatches, layout):
    needs_devices_for(layout)
    torch.manual_seed(0)
    model = ResidualMLP(d_in=16, width=64, depth=6, d_out=8)
    x = torch.randn(8, 16)
    model(x).pow(2).mean().backward()
    eager = grads(model)
    model.zero_grad(set_to_none=True)
    pipe = cuda_pipeline(model, (x,), gm=fx.symbolic_trace(model), stages=6, gpus=3, microbatches=microbatches,
                         one_device=layout == "one-device")
    out = pipe(x)
    assert out.device.type == "cpu"
    out.pow(2).mean().backward()
    assert_activations_crossed(pipe, layout, fx.symbolic_trace(model), (x[: x.shape[0] // microbatches],))
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    for name, g in grads(model).items():
        assert g.device.type == "cpu"
        torch.testing.assert_close(g, eager[name], rtol=1e-4, atol=1e-5)
    assert all(s["current_bytes"] == s["slot_pool_bytes"] for s in pipe.memory_stats().values())


def test_streams_have_priorities_compute_above_upload_above_download():
    model = ResidualMLP(d_in=8, width=16, depth=2, d_out=4)
    pipe = cuda_pipeline(model, (torch.randn(4, 8),), gm=fx.symbolic_trace(model), stages=2, gpus=2, one_device=True)
    for dev in pipe.devices.values():
        assert isinstance(dev, CudaDevice)
        assert dev.compute_stream.priority <= dev.upload_stream.priority <= dev.download_stream.priority
        assert len({dev.compute_stream, dev.upload_stream, dev.download_stream}) == 3


def test_dropout_on_cuda_with_one_microbatch_matches_cuda_eager():
    torch.manual_seed(0)
    model = nanogpt(hidden=64, blocks=2, vocab=128, seq=16, heads=2, dropout=0.2)
    (idx,) = nanogpt_inputs(model, batch=4)
    targets = torch.roll(idx, 1, dims=1)
    reference = copy.deepcopy(model).cuda()
    torch.manual_seed(3)
    logits, loss = reference(idx.cuda(), targets.cuda())
    loss.backward()
    pipe = cuda_pipeline(model, (idx, targets), stages=4, gpus=2, microbatches=1, one_device=True)
    torch.manual_seed(3)  # one CUDA generator, drawn from in the same order as eager
    p_logits, p_loss = pipe(idx, targets)
    p_loss.backward()
    torch.testing.assert_close(p_logits, logits.cpu(), rtol=1e-4, atol=1e-5)
    ref = {n: g.cpu() for n, g in grads(reference).items()}
    for name, g in grads(model).items():
        torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-5)


def assert_close_in_norm(got, want, bound, what):
    err = torch.linalg.vector_norm(got.float() - want.float())
    assert err <= bound * torch.linalg.vector_norm(want.float()), \
        f"{what}: |got - want| = {err:.3g} > {bound:.3g} |want|"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_gpt2_on_cuda_in_bfloat16_is_close_to_fp32_eager_in_norm_and_loses_no_gradient(layout):
    needs_devices_for(layout)
    torch.manual_seed(0)
    model = hf_gpt2(layers=2, hidden=64, heads=2, vocab=128, positions=16)
    (ids,) = hf_inputs(model, batch=4, seq=16)
    microbatches = 2
    reference = copy.deepcopy(model)
    out = reference(ids, labels=ids)
    out.loss.backward()
    fp32 = grads(reference)
    pipe = cuda_pipeline(model, (ids,), {"labels": ids}, stages=4, gpus=2, microbatches=microbatches,
                         dtype=torch.bfloat16, one_device=layout == "one-device")
    p_out = pipe(ids, labels=ids)
    p_out.loss.float().backward()
    got = grads(model)
    assert got.keys() == fp32.keys()
    torch.testing.assert_close(p_out.loss.float(), out.loss, rtol=2e-2, atol=2e-2)
    # Each gradient is within the bf16 roundings on its way of fp32 eager's, in norm (first
    # order, tests.models.bf16_roundings: 90 roundings here, 0.35 relative; a bf16 eager copy of
    # this model is measured at most 0.012 from fp32 on the CPU). An all-zero gradient is 1 away,
    # a micro-batch's missing share ~0.5 -- and all-zero is checked outright as well. (No bf16
    # eager reference here: on CUDA the exported graph and HF's modules may take other kernels,
    # so two bf16 runs may differ by both their errors, twice this bound. The CPU unit test
    # compares with bf16 eager bit for bit.)
    bound = bf16_roundings(model, microbatches) * BF16_UNIT_ROUNDOFF
    for name, g in got.items():
        assert g.dtype == torch.float32
        assert g.count_nonzero() > 0 or fp32[name].count_nonzero() == 0, f"{name}: all-zero gradient"
        assert_close_in_norm(g, fp32[name], bound, name)


_ARMED = {"backward": False}


class _Tripwire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        if _ARMED["backward"]:
            raise RuntimeError("tripwire in backward")
        return g


@fx.wrap
def tripwire(x):
    return _Tripwire.apply(x)


class _Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        h = tripwire(torch.tanh(self.b(torch.relu(self.a(x)))))
        return self.d(torch.tanh(self.c(h)))


def test_an_error_in_a_stage_backward_frees_every_cuda_copy_and_the_pipeline_recovers():
    torch.manual_seed(0)
    model = _Fragile()
    x = torch.randn(8, 16)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    cuts = [names.index("b"), names.index("tripwire"), names.index("c")]
    bounds = [0, *cuts, len(names)]
    pipe = build_pipeline(model, gm, stage_nodes=[names[a:b] for a, b in zip(bounds, bounds[1:])],
                          stage_gpus=["gpu0", "gpu1"] * 2, gpu_budgets={}, microbatches=2, example_inputs=(x,),
                          device="cuda", gpu_indices={"gpu0": 0, "gpu1": 0})
    pipe(x).sum().backward()  # warm the allocator
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    _ARMED["backward"] = True
    try:
        with pytest.raises(RuntimeError, match="tripwire in backward"):
            pipe(x).sum().backward()
    finally:
        _ARMED["backward"] = False
    gc.collect()
    torch.cuda.synchronize()
    assert all(s["current_bytes"] == s["slot_pool_bytes"] for s in pipe.memory_stats().values())
    assert torch.cuda.memory_allocated() <= before
    assert all(p.grad is None for p in model.parameters())
    pipe(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_budget_smaller_than_a_stage_raises_before_allocating():
    """The slot pools are allocated when the pipeline is built, so a budget below one stage's
    weights is refused there, before any CUDA memory is taken (and not at the first call)."""
    model = ResidualMLP(d_in=16, width=64, depth=4, d_out=8)
    x = torch.randn(8, 16)
    gm = fx.symbolic_trace(model)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    with pytest.raises(MobiusError, match="budget"):
        build_pipeline(model, gm, stage_nodes=even_cut(gm, 4), stage_gpus=["gpu0", "gpu1"] * 2,
                       gpu_budgets={"gpu0": 1024, "gpu1": 1024}, microbatches=2, example_inputs=(x,),
                       device="cuda", gpu_indices={"gpu0": 0, "gpu1": 0})
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) == before


def test_adamw_steps_on_cuda_follow_the_cpu_loss_curve():
    torch.manual_seed(0)
    model = nanogpt(hidden=64, blocks=2, vocab=128, seq=16, heads=2)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (4, 17), generator=g) for _ in range(2)] * 5
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in data]
    pipe = cuda_pipeline(model, batches[0], stages=4, gpus=2, microbatches=2)

    def train(fn, params):
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses = []
        for idx, targets in batches:
            opt.zero_grad(set_to_none=True)
            _, loss = fn(idx, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    torch.testing.assert_close(train(pipe, model.parameters()), train(reference, reference.parameters()),
                               rtol=0, atol=1e-3)


def test_the_books_match_what_the_cuda_allocator_holds():
    # One pipeline GPU on cuda:0 and nothing else on it: its books against the caching
    # allocator. The books charge every storage a stage's work creates, rounded up to the
    # allocator's 512 bytes, while it lives, so their peak lies between the peak of the bytes
    # requested (`requested_bytes`, unrounded) and of the blocks handed out (`memory_allocated`,
    # which may also hand out a cached block up to 1 MiB larger than asked). Tensors of megabytes
    # keep the gaps small; the old books, which missed working memory, were 1.3-1.6x below.
    # The per-op books are memory_books="ops" (on CUDA the debug measurement; the default,
    # "allocator", reads this allocator: tests/gpu/test_cuda_books.py).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Linear(2048, 256), nn.Linear(256, 2048), nn.ReLU(),
                          nn.Linear(2048, 256))
    x = torch.randn(1024, 256)
    gm = fx.symbolic_trace(model)
    pipe = build_pipeline(model, gm, stage_nodes=even_cut(gm, 3), stage_gpus=["gpu0"] * 3, gpu_budgets={},
                          microbatches=2, example_inputs=(x,), device="cuda", gpu_indices={"gpu0": 0},
                          memory_books="ops")
    pipe(x).pow(2).mean().backward()  # warm up: the allocator, cuBLAS workspaces
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    stats = pipe.memory_stats()["gpu0"]
    assert stats["current_bytes"] == stats["slot_pool_bytes"]
    stats = torch.cuda.memory_stats(0)
    base_alloc = stats["allocated_bytes.all.current"]
    base_req = stats.get("requested_bytes.all.current", base_alloc)
    torch.cuda.reset_peak_memory_stats(0)
    pipe.reset_peak_memory_stats()
    pipe(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats(0)
    pool = pipe.memory_stats()["gpu0"]["slot_pool_bytes"]  # held since compile: in the base, and in the books
    allocated = stats["allocated_bytes.all.peak"] - base_alloc + pool
    requested = stats.get("requested_bytes.all.peak", stats["allocated_bytes.all.peak"]) - base_req + pool
    books = pipe.memory_stats()["gpu0"]["peak_bytes"]
    assert 0.98 * requested <= books <= 1.02 * allocated + 2**20, (requested, books, allocated)
    gc.collect()
    torch.cuda.synchronize()
    stats = pipe.memory_stats()["gpu0"]
    assert stats["current_bytes"] == stats["slot_pool_bytes"]
    assert torch.cuda.memory_allocated(0) <= base_alloc + 2**20  # nothing the books forgot stays behind


def test_peak_gpu_memory_stays_within_the_plan():
    """The slot pool bounds a GPU by construction: whatever the host's speed, the caching
    allocator's peak over a training step stays within what the plan budgets for the GPU -- the
    largest pair of consecutive stages' footprints on it (the double buffer the partitioner keeps
    under its memory) -- and within the topology's memory."""
    import mobius_fx
    from mobius_fx import Topology

    torch.manual_seed(0)
    model = nanogpt(hidden=256, blocks=6, vocab=512, seq=128)
    (x,) = nanogpt_inputs(model, batch=8, device="cpu")
    weights = sum(p.numel() * 4 for p in model.parameters())
    topo = Topology.virtual(gpus=1, memory=3 * weights)  # too small for the model resident with its work: 8 stages
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=4, device="cuda", verbose=False)
    stages = pipe.plan.stages
    assert len(stages) > 2
    planned = max(a.peak_bytes + b.peak_bytes for a, b in zip(stages, stages[1:]))
    loss = torch.nn.functional.cross_entropy(pipe(x).flatten(0, 1), x.flatten())
    loss.backward()  # warm up: cuBLAS workspaces, the allocator's pools
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(0)
    # the pipeline's books (memory_books="allocator") reset torch's peak at each stage's work:
    # the device's peak over the steps is the allocator source's
    allocator = CudaAllocator.of(0)
    allocator.reset_max()
    for _ in range(2):
        torch.nn.functional.cross_entropy(pipe(x).flatten(0, 1), x.flatten()).backward()
    torch.cuda.synchronize()
    # the slot pool, allocated when compiled and kept, is in `base`: count it in again
    peak = allocator.max_allocated() - base + pipe.memory_stats()["gpu0"]["slot_pool_bytes"]
    assert peak <= planned + 2**20, (peak, planned)
    assert peak <= topo.gpus[0].memory, (peak, topo.gpus[0].memory)

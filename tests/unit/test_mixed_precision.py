"""Mixed precision: weights streamed in bf16/fp16, fp32 masters and gradients, loss scaling.

Tolerances. bf16 keeps 8 significand bits (unit roundoff u = 2^-8 ≈ 0.0039), fp16 11 bits
(u = 2^-11 ≈ 0.00049). Eager autocast and the pipeline round differently: the pipeline holds
*every* weight in the streamed dtype (LayerNorm and embeddings too, so the residual stream is
bf16 where eager autocast keeps it fp32), accumulates a stage's weight gradients over the
micro-batches in that dtype, and recomputes in backward. Through the 4-block GPT below both
paths stay a few u from fp32 (measured: eager autocast 2.2u, the pipeline 2.5-3.3u, pipeline
vs autocast 2.3-3.0u in bf16; 3.1u in fp16, normwise per parameter), so we allow 8u between
them, normwise per parameter. A wrong gradient (missed micro-batch, double count, stale
weights) is off by 50% or more and fails by far.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import Topology, zoo
from mobius_fx.planning.plans import build_plan
from mobius_fx.build import build_pipeline
from mobius_fx.precision import Precision
from mobius_fx.tracing import trace
from mobius_fx.zoo import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module

BF16_U = 2.0**-8
FP16_U = 2.0**-11


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, seq=16, hidden=32, blocks=4, heads=2))


def _topo(model, gpus=2, times=4):
    return Topology.virtual(gpus=gpus, memory=times * sum(p.numel() * 4 for p in model.parameters()))


def _loss(logits, x):
    return F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())


def _compile(model, x, dtype, cache, microbatches=2, times=4):
    return mobius_fx.compile(model, _topo(model, times=times), example_inputs=(x,), microbatches=microbatches,
                             dtype=dtype, cache_dir=str(cache), verbose=False)


def _max_rel_err(model, ref):
    return max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), ref.parameters()))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    model = _gpt()
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, torch.bfloat16, tmp_path_factory.mktemp("bf16"))
    return pipe, model, eager, x


def test_bf16_pipeline_loss_and_grads_match_eager_autocast(bf16):
    pipe, model, eager, x = bf16
    model.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    loss = _loss(pipe(x), x)
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss(eager(x), x)
    ref.backward()
    # The loss is a mean of ~ln(64) ≈ 4.2 per token: within a few bf16 roundings of it.
    assert abs(loss.item() - ref.item()) <= 8 * BF16_U * abs(ref.item())
    assert _max_rel_err(model, eager) <= 8 * BF16_U


def test_bf16_weight_gradients_land_in_fp32_master_grads_and_accumulate(bf16):
    pipe, model, _, x = bf16
    model.zero_grad(set_to_none=True)
    _loss(pipe(x), x).backward()
    once = [p.grad.clone() for p in model.parameters()]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    _loss(pipe(x), x).backward()  # same weights, same batch: the same gradient added again
    for p, g in zip(model.parameters(), once):
        torch.testing.assert_close(p.grad, 2 * g)


def test_bf16_outputs_come_back_in_the_dtype_autocast_gives_them(bf16):
    pipe, _, eager, x = bf16
    with torch.no_grad():
        out = pipe(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = eager(x)
    assert out.dtype == ref.dtype == torch.bfloat16  # lm_head is a matmul: lower precision, as autocast
    assert out.device.type == "cpu"


def test_the_callers_autocast_is_replayed_in_the_backward_recomputation(tmp_path):
    # dtype=None: no autocast of our own, but one around the call must also cover the recompute,
    # which runs later in backward, outside the caller's `with` block.
    model = _gpt()
    eager = copy.deepcopy(model)
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
    pipe = _compile(model, x, None, tmp_path, microbatches=1, times=6)  # one micro-batch: the whole batch's activations
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
        ref = eager(x)
    assert out.dtype == torch.bfloat16
    _loss(out, x).backward()
    _loss(ref, x).backward()
    # fp32 weights, one micro-batch: the very ops eager autocast runs, so the gradients agree to
    # fp32 summation order; a recomputation without autocast would be ~2 bf16 roundings (1%) off.
    assert _max_rel_err(model, eager) <= 1e-4


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.body(x)), y)


def test_bf16_stages_run_under_autocast_so_a_loss_inside_the_model_is_fp32(tmp_path):
    torch.manual_seed(0)
    model = _Classifier()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    pipe = mobius_fx.compile(model, _topo(model), example_inputs=(x, y), microbatches=2, dtype=torch.bfloat16,
                             cache_dir=str(tmp_path), verbose=False)
    loss = pipe(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = eager(x, y)
    assert loss.dtype == ref.dtype == torch.float32  # cross_entropy is on autocast's fp32 list
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 8 * BF16_U * abs(ref.item())
    assert _max_rel_err(model, eager) <= 8 * BF16_U


@pytest.fixture(scope="module")
def fp16(tmp_path_factory):
    model = _gpt()
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(3))
    pipe = _compile(model, x, torch.float16, tmp_path_factory.mktemp("fp16"))
    return pipe, model, x


def _scaled_step(pipe, model, x, scaler, opt, blow_up=1.0):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(pipe(x), x) * blow_up
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_fp16_overflow_skips_the_step_and_leaves_weights_unchanged(fp16):
    pipe, model, x = fp16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")  # torch's own: it unscales CPU fp32 master grads
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale = scaler.get_scale()
    _scaled_step(pipe, model, x, scaler, opt, blow_up=1e6)  # 1e6 * 65536 * dlogits overflows fp16
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scaler.get_scale() == scale / 2


def test_fp16_scaled_step_without_overflow_updates_every_weight_like_eager_autocast(fp16):
    pipe, model, x = fp16
    eager = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = torch.amp.GradScaler("cpu")
    _scaled_step(pipe, model, x, scaler, torch.optim.SGD(model.parameters(), lr=0.1), blow_up=1.0)
    eager_scaler = torch.amp.GradScaler("cpu")
    _scaled_step(eager, eager, x, eager_scaler, torch.optim.SGD(eager.parameters(), lr=0.1))
    assert scaler.get_scale() == eager_scaler.get_scale() == 65536.0  # no inf: scale kept
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name
        assert p.grad.dtype == torch.float32  # unscaled master gradient
    assert _max_rel_err(model, eager) <= 8 * FP16_U


def _stage_gm(model, x):
    return trace(model, example_inputs=(x,))


def test_virtual_gpus_count_bf16_weight_copies_at_two_bytes_per_element(bf16):
    pipe, model, _, x = bf16
    half_model = copy.deepcopy(model)
    full_model = copy.deepcopy(model)
    half = build_pipeline(half_model, _stage_gm(half_model, x), plan=pipe.plan, example_inputs=(x,),
                          device="virtual")  # the plan's dtype: bfloat16
    full = build_pipeline(full_model, _stage_gm(full_model, x), plan=pipe.plan, example_inputs=(x,),
                          device="virtual", dtype=torch.float32)
    for p in (half, full):
        _loss(p(x), x).backward()
    elements = sum(m.numel() for st in half._rt.stages for m in st.masters)
    assert all(m.is_floating_point() for st in half._rt.stages for m in st.masters)
    weight_up = {n: s.get("weight h2d", {}).get("bytes", 0) for n, s in half.transfer_stats(last_step=True).items()}
    weight_up_fp32 = {n: s.get("weight h2d", {}).get("bytes", 0) for n, s in full.transfer_stats(last_step=True).items()}
    assert sum(weight_up_fp32.values()) == 2 * sum(weight_up.values())
    assert sum(st.weight_bytes for st in half._rt.stages) == 2 * elements  # 2 bytes per streamed element
    for gpu, s in half.memory_stats().items():
        ratio = s["peak_bytes"] / full.memory_stats()[gpu]["peak_bytes"]
        assert 0.45 <= ratio <= 0.55, (gpu, ratio)  # weights, gradients and activations all halve


def test_bf16_plan_of_the_8b_gpt_moves_half_the_weight_bytes_of_fp32(tmp_path):
    model, inputs = zoo.build("gpt3-8b", batch=8, seq=1024)  # meta device
    plan = mobius_fx.plan(model, "mobius-testbed", example_inputs=inputs, microbatches=8, dtype=torch.bfloat16,
                          time_limit=3, cache_dir=str(tmp_path), verbose=False)
    assert plan.dtype == torch.bfloat16 and plan.precision == Precision(torch.bfloat16, torch.float32)
    # The fp32 plan with the same layers, cut at the same boundaries on the same GPUs.
    cuts, at = [], 0
    for s in plan.stages:
        cuts.append(at)
        at += len(s.layers)
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)}
    kw = dict(order=plan.order, topology=plan.topology, microbatches=8, step_time=0.0, param_sizes=sizes,
              input_bytes=sum(t.numel() * t.element_size() for t in inputs))
    half = build_plan(plan.layers, cuts, precision=plan.precision, **kw)
    full = build_plan(plan.layers, cuts, precision=Precision.of(None, master=torch.float32), **kw)

    def weight_bytes(p):
        return sum(t.bytes * t.count for t in p.transfers if t.kind == "prefetch")

    assert weight_bytes(half) == weight_bytes(plan)  # build_plan reproduces what plan() built
    assert weight_bytes(full) == 2 * weight_bytes(plan)
    assert weight_bytes(plan) > 2 * 8.3e9  # every weight goes up at least once, at 2 bytes
    # The transfer table shows the bf16 size of a transformer block: 12 h^2 + 13 h elements.
    h = 3072
    block = (12 * h * h + 13 * h) * 2
    assert any(t.kind == "prefetch" and t.bytes == block for t in plan.transfers)
    assert f"{block / 2**20:.2f} MiB" in plan.transfer_table()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_pipeline_matches_eager_autocast(tmp_path):
    model = _gpt()
    eager = copy.deepcopy(model).cuda()
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(4))
    pipe = mobius_fx.compile(model, _topo(model), example_inputs=(x,), microbatches=2, dtype=torch.bfloat16,
                             device="cuda", cache_dir=str(tmp_path), verbose=False)
    loss = _loss(pipe(x), x)
    loss.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = _loss(eager(x.cuda()), x.cuda())
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 8 * BF16_U * abs(ref.item())
    assert max(((p.grad - q.grad.cpu()).norm() / q.grad.norm()).item()
               for p, q in zip(model.parameters(), eager.parameters())) <= 8 * BF16_U
    st = pipe.devices["gpu0"].streamed_copies
    assert len(st) and all(e.host.dtype == torch.bfloat16 and e.host.is_pinned() for e in st.entries()
                           if e.master.is_floating_point())


class _UpcastThenNorm(torch.nn.Module):
    """As HF GPT-2 in bf16 does: an fp32 activation into a LayerNorm whose GPU copy is bf16."""

    def __init__(self):
        super().__init__()
        self.a, self.ln, self.b = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.ln(self.a(x).float()))


def test_bf16_on_the_cpu_runs_layer_norm_in_fp32_as_cuda_autocast_does():
    torch.manual_seed(0)
    model, x = _UpcastThenNorm(), torch.randn(4, 16)
    eager = copy.deepcopy(model)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2], dtype=torch.bfloat16, verbose=False)
    y = pipe(x)  # CPU autocast alone: "mixed dtype (CPU): expect parameter to have scalar type of Float"
    y.float().square().sum().backward()
    ref = eager(x)
    ref.square().sum().backward()
    # every operand and result rounded to bf16 (about 8 roundings of u each on the way): well within 16u
    assert (y.float() - ref).abs().max() <= 16 * BF16_U * ref.abs().max()
    assert _max_rel_err(model, eager) <= 16 * BF16_U

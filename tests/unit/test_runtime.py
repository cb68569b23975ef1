"""The pipeline trains like the eager model: same outputs, losses and gradients, on virtual GPUs.

Every test builds a small model, traces it with torch.fx, cuts it into stages by hand and runs
the pipeline on virtual GPUs (the CPU with byte budgets), then compares with eager PyTorch.
"""

import copy
import functools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from mobius_fx import MobiusError
from mobius_fx.runtime.device_books import nbytes
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import ResidualMLP, SkipNet
from tests.models import BF16_UNIT_ROUNDOFF, bf16_roundings

_COMPUTE = ("call_function", "call_method", "call_module")

pytestmark = pytest.mark.usefixtures("one_thread")



def cut(gm: fx.GraphModule, stages: int | None = None, at: list[int] | None = None) -> list[list[str]]:
    """Contiguous stages of gm's compute nodes: `stages` even parts, or cut before indices `at`."""
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    if at is None:
        at = [round(i * len(names) / stages) for i in range(1, stages)]
    bounds = [0, *at, len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def pipeline(model, *inputs, stages=4, gpus=2, microbatches=1, budget=None, at=None, gm=None, **kw):
    gm = gm if gm is not None else fx.symbolic_trace(model)
    nodes = cut(gm, stages, at)
    names = [f"gpu{i}" for i in range(gpus)]
    return build_pipeline(model, gm, stage_nodes=nodes, stage_gpus=[names[k % gpus] for k in range(len(nodes))],
                          gpu_budgets={g: budget for g in names}, microbatches=microbatches,
                          example_inputs=inputs, device="virtual", **kw)


def step(fn, model, *inputs, loss=lambda out: out.pow(2).mean()):
    """Run forward + backward from zeroed grads; (output, loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    out = fn(*inputs)
    value = loss(out)
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, value.detach(), grads


def assert_same_step(a, b):
    out_a, loss_a, grads_a = a
    out_b, loss_b, grads_b = b
    torch.testing.assert_close(out_a, out_b)
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=lambda m: f"{name}: {m}")


def all_freed(pipe):
    """Every GPU holds nothing but its slot pool (CUDA-like devices keep it step after step)."""
    return all(s["current_bytes"] == s.get("slot_pool_bytes", 0) for s in pipe.memory_stats().values())


# ----------------------------------------------------------------------------- equality

@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_outputs_loss_and_gradients_equal_eager(microbatches):
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(8, 8)
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=microbatches)
    assert_same_step(step(model, model, x), step(pipe, model, x))
    assert all_freed(pipe)


def test_more_stages_than_twice_the_gpus_and_gpu_order_other_than_identity():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=6, d_out=4)
    x = torch.randn(6, 8)
    gm = fx.symbolic_trace(model)
    nodes = cut(gm, 6)
    pipe = build_pipeline(model, gm, stage_nodes=nodes, stage_gpus=["gpu2", "gpu0", "gpu1"] * 2,
                          gpu_budgets={}, microbatches=3, example_inputs=(x,), device="virtual")
    assert_same_step(step(model, model, x), step(pipe, model, x))


def test_dropout_with_one_microbatch_matches_eager_under_the_same_seed():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            h = self.drop(F.relu(self.a(x)))
            h = F.dropout(F.relu(self.b(h)), 0.3, training=self.training)
            return self.c(self.drop(h))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(16, 8)
    pipe = pipeline(model, x, stages=3, gpus=2)
    torch.manual_seed(123)
    eager = step(model, model, x)
    torch.manual_seed(123)
    piped = step(pipe, model, x)
    assert_same_step(eager, piped)
    assert (piped[0] != 0).any()


def test_dropout_masks_of_the_recompute_match_the_forward_with_several_microbatches():
    # Gradients can only equal eager's if the backward recomputes the very masks the forward drew.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 4)

        def forward(self, x):
            return self.b(F.dropout(self.a(x), 0.5, training=True))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(8, 8)
    pipe = pipeline(model, x, stages=2, gpus=2, microbatches=2, at=[2])  # dropout in stage 0
    torch.manual_seed(7)  # the pipeline draws stage 0's masks micro-batch by micro-batch
    eager = step(lambda x: torch.cat([model(x[:4]), model(x[4:])]), model, x)
    torch.manual_seed(7)
    assert_same_step(eager, step(pipe, model, x))


def test_weight_used_in_two_stages_is_fetched_by_both_and_gets_the_summed_gradient():
    class Tied(nn.Module):  # one Linear applied at both ends, as tied embedding / lm_head are
        def __init__(self):
            super().__init__()
            self.shared, self.mid1, self.mid2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.shared(torch.tanh(self.mid2(torch.tanh(self.mid1(self.shared(x))))))

    torch.manual_seed(0)
    model = Tied()
    x = torch.randn(4, 8)
    gm = fx.symbolic_trace(model)
    pipe = pipeline(model, x, stages=3, gpus=3, gm=gm, at=[1, 4])
    first, last = pipe.schedule.stages[0], pipe.schedule.stages[2]
    assert {w.name for w in first.weights} >= {"shared.weight"} and {w.name for w in last.weights} >= {"shared.weight"}
    assert_same_step(step(model, model, x), step(pipe, model, x))
    uploads = {g: s.get("weight h2d", {}).get("bytes", 0) for g, s in pipe.transfer_stats().items()}
    shared = sum(p.numel() * 4 for p in model.shared.parameters())
    assert uploads["gpu0"] >= shared and uploads["gpu2"] >= shared  # both stages fetched it


def test_frozen_parameters_get_no_grad_and_their_gradients_are_never_sent_back():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    for p in model.blocks[:2].parameters():
        p.requires_grad_(False)
    x = torch.randn(8, 8)
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=2)
    eager = step(model, model, x)
    piped = step(pipe, model, x)
    assert_same_step(eager, piped)
    assert all(p.grad is None for p in model.blocks[:2].parameters())
    sent = sum(s.get("gradient d2h", {}).get("bytes", 0) for s in pipe.transfer_stats().values())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert sent == trainable


def test_batchnorm_statistics_update_once_per_forward_and_not_in_recompute():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                          nn.ReLU(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = pipeline(model, x, stages=3, gpus=2)
    assert_same_step(step(eager, eager, x), step(pipe, model, x))
    for (name, b), (_, ref) in zip(model.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(b, ref, msg=lambda m: f"{name}: {m}")
    assert int(model[1].num_batches_tracked) == 1


def test_batchnorm_statistics_update_once_per_microbatch_in_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = pipeline(model, x, stages=2, gpus=2, microbatches=2)
    pipe(x).sum().backward()
    with torch.no_grad():
        eager(x[:4]), eager(x[4:])
    torch.testing.assert_close(model[1].running_mean, eager[1].running_mean)
    torch.testing.assert_close(model[1].running_var, eager[1].running_var)
    assert int(model[1].num_batches_tracked) == 2


def test_skip_connection_across_several_stages_goes_through_host_memory():
    torch.manual_seed(0)
    model = SkipNet(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(8, 8)
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=2, at=[1, 4, 7])
    # Stage 0's output (the skip) goes to host memory once per micro-batch and from there to stage 3.
    meta = lambda n: n.meta.get("mobius", {})  # noqa: E731
    hosted = [n for n in pipe.program.graph.nodes if meta(n).get("op") == "send" and meta(n)["gpu"] == "host"]
    assert sorted((meta(n)["stage"], meta(n)["microbatch"]) for n in hosted) == [(0, 0), (0, 1), (3, 0), (3, 1)]
    for n in hosted:
        if meta(n)["stage"] == 0:
            assert [(meta(u)["op"], meta(u)["stage"], meta(u)["gpu"]) for u in n.users] == [("send", 3, "gpu1")]
    assert_same_step(step(model, model, x), step(pipe, model, x))
    assert all_freed(pipe)


def test_several_inputs_kwargs_and_structured_outputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x, y, mask=None, scale: float = 1.0):
            h = torch.relu(self.a(x) + y)
            g = self.b(h) * scale
            if mask is not None:
                g = g * mask
            return {"logits": self.c(g), "hidden": (h, g), "mean": g.mean()}

    torch.manual_seed(0)
    model = Net()
    x, y, mask = torch.randn(8, 8), torch.randn(8, 8), (torch.rand(8, 8) > 0.3).float()
    gm = fx.symbolic_trace(model)
    pipe = pipeline(model, x, y, mask, stages=3, gpus=2, microbatches=2, gm=gm)

    def loss(out):
        return out["logits"].pow(2).sum() + out["hidden"][0].mean() + out["mean"]

    eager = step(lambda *a: model(*a), model, x, y, mask, loss=loss)
    piped = step(lambda *a: pipe(x, y=y, mask=mask), model, x, y, mask, loss=loss)
    assert type(piped[0]) is dict and type(piped[0]["hidden"]) is tuple
    torch.testing.assert_close(piped[0], eager[0])
    torch.testing.assert_close(piped[1], eager[1])
    for name in eager[2]:
        torch.testing.assert_close(piped[2][name], eager[2][name])


def test_python_values_and_tuples_cross_stage_boundaries():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 4)

        def forward(self, x):
            n = x.size(0)  # an int used two stages later
            left, right = self.a(x).chunk(2, dim=-1)  # a tuple crossing a cut
            return self.b(torch.tanh(left) * right).reshape(n, -1)

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(6, 8)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    pipe = pipeline(model, x, stages=3, gpus=2, microbatches=3, gm=gm, at=[names.index("chunk") + 1,
                                                                           names.index("b")])
    assert_same_step(step(model, model, x), step(pipe, model, x))


def test_integer_inputs_and_frozen_first_stage_need_no_backward_there():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    model[0].weight.requires_grad_(False)
    ids = torch.randint(0, 16, (4, 5))
    pipe = pipeline(model, ids, stages=2, gpus=2, microbatches=2, at=[1])
    assert_same_step(step(model, model, ids), step(pipe, model, ids))
    assert all_freed(pipe)


# ----------------------------------------------------------------------------- the user's model

def test_build_pipeline_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model[0].weight.grad = torch.ones_like(model[0].weight)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    buffers = {n: (b, b.clone()) for n, b in model.named_buffers()}
    pipeline(model, torch.randn(4, 8), stages=2, gpus=2, microbatches=2)
    for n, (p, value) in params.items():
        assert model.get_parameter(n) is p and torch.equal(p, value)
    for n, (b, value) in buffers.items():
        assert model.get_buffer(n) is b and torch.equal(b, value)
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight)) and model[3].weight.grad is None


def test_gradients_accumulate_into_existing_grad_like_eager():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=2, d_out=4)
    x = torch.randn(4, 8)
    pipe = pipeline(model, x, stages=2, gpus=2, microbatches=2)
    pipe(x).sum().backward()
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    pipe(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n])


def test_pipeline_parameters_are_the_model_masters_and_it_cannot_be_moved():
    model = ResidualMLP(d_in=8, width=16, depth=2, d_out=4)
    pipe = pipeline(model, torch.randn(4, 8), stages=2, gpus=2)
    assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()]
    with pytest.raises(MobiusError, match="master weights on the CPU"):
        pipe.to(torch.float64)


def test_eval_mode_of_the_model_reaches_the_stages():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    pipe = pipeline(model, x, stages=2, gpus=2)
    pipe.eval()
    assert not model.training
    torch.testing.assert_close(pipe(x), model(x))


# ----------------------------------------------------------------------------- memory

def test_last_stage_of_each_gpu_stays_resident_for_backward_then_everything_is_freed():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(4, 8)
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=2)
    out = pipe(x)
    resident = [k for k, st in enumerate(pipe._rt.stages) if st.resident]
    assert resident == [2, 3]
    out.sum().backward()
    assert not any(st.resident for st in pipe._rt.stages) and all_freed(pipe)


def test_forward_without_grad_evicts_every_stage():
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(4, 8)
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=2)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad and all_freed(pipe)


def record_resident_stages(pipe) -> dict[tuple[str, str], int]:
    """Watch the runtime: after every prefetch, wait and evict (the only ops that change which
    stages are resident, whoever calls them: the program in forward, the stage calls in
    backward), note per (phase, GPU) the most stages resident at once. Returns the live dict."""
    rt = pipe._rt
    most: dict[tuple[str, str], int] = {}

    def note_resident() -> None:
        phase = "backward" if rt.step is not None and rt.step.state == "backward" else "forward"
        for gpu in rt.devices:
            n = sum(1 for st in rt.stages if st.resident and st.device.name == gpu)
            most[(phase, gpu)] = max(most.get((phase, gpu), 0), n)

    def watched(op):
        def run(*args, **kwargs):
            try:
                return op(*args, **kwargs)
            finally:
                note_resident()
        return run

    for name in ("prefetch", "wait", "evict"):
        setattr(rt, name, watched(getattr(rt, name)))  # instance attributes win over the methods
    return most


def test_at_most_two_stages_are_resident_per_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # weights dominate activations
    x = torch.randn(2, 64)
    pipe = pipeline(model, x, stages=8, gpus=2, microbatches=2)
    most = record_resident_stages(pipe)
    for _ in range(2):  # the second step starts from a pipeline that already ran one
        pipe(x).sum().backward()
    # Stage k+N is prefetched while stage k runs, in forward and (k-N) in backward: exactly two,
    # never three, on each GPU in each phase.
    assert most == {(phase, gpu): 2 for phase in ("forward", "backward") for gpu in ("gpu0", "gpu1")}
    stage_bytes = 64 * 65 * 4
    for stats in pipe.memory_stats().values():
        # two stages' weights + one stage's summed gradients + the fresh gradients of the micro-batch
        # being summed in (the books see them) + a few small activations
        assert 2 * stage_bytes < stats["peak_bytes"] < 4 * stage_bytes + 4096


class LiveBytes(TorchDispatchMode):
    """The bytes really held on each virtual GPU of `pipe`, at every op: the weight slots' storage
    plus every storage an op created while that GPU was at work -- its stage's forward, its
    backward's recompute and gradients, an activation received onto it -- for as long as the
    storage lives (views counted once). `peak[gpu]` is the most seen at once.

    Host copies are what a CUDA device makes: `offload` makes one on virtual GPUs too; `download`
    hands out an alias of the GPU tensor, which would keep it "on the GPU" for ever, so here it
    is made a real copy, outside any GPU's account.
    """

    def __init__(self, pipe):
        super().__init__()
        rt = self.rt = pipe._rt
        self.peak = {gpu: 0 for gpu in rt.devices}
        self.owner: list[str | None] = []  # the GPU at work now (innermost last); None: the host
        self.live: dict[int, tuple[StorageWeakRef, str, int]] = {}  # storage -> (ref, gpu, bytes)
        self.slots = {StorageWeakRef(s.untyped_storage()).cdata for st in rt.stages for s in st.slots}

        def working(fn, gpu_of):
            def run(*args, **kwargs):
                self.owner.append(gpu_of(*args))
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.owner.pop()
            return run

        stage_gpu = lambda call, *_: rt.stages[call.stage].device.name  # noqa: E731
        rt._forward = working(rt._forward, stage_gpu)
        rt._backward_call = working(rt._backward_call, stage_gpu)

        def download(t, kind, into=None, addends=(), *, _download):
            got = _download(t, kind, into, addends)()
            host = got if into is not None else got.clone()  # a download into a .grad home is that home
            return lambda: host

        host = lambda *_: None  # noqa: E731
        for dev in rt.devices.values():
            dev.receive = working(dev.receive, lambda *_, name=dev.name: name)
            dev.offload = working(dev.offload, host)
            dev.download = working(functools.partial(download, _download=dev.download), host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        gpu = self.owner[-1] if self.owner else None
        if gpu is not None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    ref = StorageWeakRef(storage)
                    if ref.cdata not in self.slots and ref.cdata not in self.live:
                        self.live[ref.cdata] = (ref, gpu, storage.nbytes())
        self.sample()
        return out

    def sample(self):
        held = dict.fromkeys(self.peak, 0)
        for st in self.rt.stages:
            held[st.device.name] += sum(s.untyped_storage().nbytes() for s in st.slots)
        for key, (ref, gpu, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
            else:
                held[gpu] += n
        for gpu, n in held.items():
            self.peak[gpu] = max(self.peak[gpu], n)


class BooksBelowRealPeak(AssertionError):
    """The books' peak of a GPU is below the bytes really held on it."""


def test_the_books_peak_is_at_least_the_bytes_really_held_on_each_gpu():
    torch.manual_seed(0)
    # Wide hidden layers inside each stage: working memory the size of the weights.
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 16))])
    x = torch.randn(32, 16)
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=2)
    eager = step(model, model, x)
    live = LiveBytes(pipe)
    with live:
        piped = step(pipe, model, x)
    assert_same_step(eager, piped)  # the tracker changed nothing the step computes
    books = {gpu: s["peak_bytes"] for gpu, s in pipe.memory_stats().items()}
    stage_weights = (16 * 128 + 128 + 128 * 16 + 16) * 4
    assert all(live.peak[gpu] > 2 * stage_weights for gpu in books)  # it sees two stages resident, and more
    if any(live.peak[gpu] > books[gpu] for gpu in books):
        raise BooksBelowRealPeak(f"bytes really held at peak {live.peak} > the books' peak {books}")
    assert all(books[gpu] <= 1.1 * live.peak[gpu] for gpu in books)  # and they invent nothing


def test_an_evicted_weight_cannot_be_used():
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(4, 8)
    pipe = pipeline(model, x, stages=4, gpus=2)
    pipe(x)
    stage0 = pipe._rt.stages[0]
    assert all(s.untyped_storage().nbytes() == 0 for s in stage0.slots if s.numel())
    with pytest.raises(RuntimeError):
        stage0.module(x)


def test_exceeding_a_budget_raises_naming_gpu_bytes_and_budget():
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(4, 8)
    pipe = pipeline(model, x, stages=4, gpus=2, budget=1000)
    with pytest.raises(MobiusError, match=r"gpu0 would hold .*\(\d+ bytes: stage 0's weights.* budget .*\(1000 bytes\)"):
        pipe(x)
    assert all_freed(pipe)


def test_a_batch_that_microbatches_do_not_divide_is_rejected():
    model = ResidualMLP(d_in=8, width=16, depth=2, d_out=4)
    with pytest.raises(MobiusError, match=r"batch has 6 rows .* 4 equal micro-batches.*multiple of 4"):
        pipeline(model, torch.randn(6, 8), stages=2, gpus=2, microbatches=4)
    pipe = pipeline(model, torch.randn(8, 8), stages=2, gpus=2, microbatches=4)
    with pytest.raises(MobiusError, match="does not split into 4"):
        pipe(torch.randn(6, 8))


# ----------------------------------------------------------------------------- failures

_ARMED = {"forward": False, "backward": False}


class _Tripwire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if _ARMED["forward"]:
            raise RuntimeError("tripwire in forward")
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
        self.a, self.bn, self.b, self.c, self.d = (nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 16),
                                                   nn.Linear(16, 16), nn.Linear(16, 4))

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        h = tripwire(torch.tanh(self.b(h)))
        return self.d(torch.tanh(self.c(h)))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_error_in_a_stage_leaves_masters_untouched_frees_gpus_and_the_pipeline_stays_usable(where):
    torch.manual_seed(0)
    model = _Fragile()
    eager = copy.deepcopy(model)
    x = torch.randn(8, 8)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=2, gm=gm,
                    at=[names.index("b"), names.index("tripwire"), names.index("c")])
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    _ARMED[where] = True
    try:
        with pytest.raises(RuntimeError, match=f"tripwire in {where}"):
            pipe(x).sum().backward()
    finally:
        _ARMED[where] = False
    assert all(torch.equal(v, params[k]) for k, v in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert all_freed(pipe)
    if where == "forward":  # a forward that failed updated no buffer either
        assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    else:  # the forward had succeeded: its BatchNorm updates stand, as in eager
        with torch.no_grad():
            eager(x[:4]), eager(x[4:])
    # Usable again, and as if the failed step never happened (BatchNorm sees micro-batches of 4).
    assert_same_step(step(lambda x: torch.cat([eager(x[:4]), eager(x[4:])]), eager, x), step(pipe, model, x))


def bf16_eager_by_microbatch(model, x, microbatches, loss_of):
    """The pipeline's bf16 arithmetic done by eager PyTorch: a bf16 copy of the model (the GPU
    copies are the masters cast to bf16), bf16 inputs (cast as they go up), each micro-batch
    under CPU autocast to bf16 (as each stage runs), `loss_of(out_i)` the micro-batch's share of
    the loss, backward for micro-batches M-1, ..., 0 (the order autograd returns them to a
    stage) so the bf16 `.grad` sums them as the pipeline's GPU accumulator does. Returns the
    output and {name: fp32 gradient}."""
    ref = copy.deepcopy(model).to(torch.bfloat16)  # (its layer norms then run in fp32 with bf16 weights cast up)
    ref.zero_grad(set_to_none=True)
    chunks = [c.to(torch.bfloat16) for c in x.split(x.size(0) // microbatches)]
    outs: list[torch.Tensor] = [torch.empty(0)] * microbatches
    from mobius_fx.runtime.engine import NormsInFp32

    for i in reversed(range(microbatches)):
        # layer norms in fp32, as CUDA's autocast (and so the virtual GPUs standing in for it) runs them
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), NormsInFp32():
            out = ref(chunks[i])
        loss_of(out).backward()
        outs[i] = out.detach()
    return torch.cat(outs), {n: p.grad.float() for n, p in ref.named_parameters()}


def test_bfloat16_streaming_equals_bf16_eager_is_close_to_fp32_eager_and_keeps_fp32_gradients():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)  # its GELUs are functional calls, not modules
    x = torch.randn(8, 8)
    microbatches = 2
    pipe = pipeline(model, x, stages=4, gpus=2, microbatches=microbatches, dtype=torch.bfloat16)
    eager = step(model, model, x)
    out, loss, grads = step(pipe, model, x, loss=lambda o: o.float().pow(2).mean())
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads.values())
    assert grads.keys() == eager[2].keys()

    # Fair comparison: the same bf16 arithmetic in the same order, bit for bit. (The mean over
    # 8 x 4 outputs splits exactly into per-micro-batch sums / 32: a power of two.)
    ref_out, ref_grads = bf16_eager_by_microbatch(model, x, microbatches,
                                                  lambda o: o.float().pow(2).sum() / out.numel())
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")

    # Closeness to fp32: within the bf16 roundings on the way, in norm (an elementwise bound
    # would be meaningless for gradient entries near zero). Here 53 roundings: 0.21 relative
    # (measured: at most 0.013), short of an all-zero or half-missing gradient (1 and 0.5); the
    # bit-exact comparison above is the strict one.
    bound = bf16_roundings(model, microbatches) * BF16_UNIT_ROUNDOFF
    assert torch.linalg.vector_norm(out.float() - eager[0]) <= bound * torch.linalg.vector_norm(eager[0])
    for name, g in eager[2].items():
        err = torch.linalg.vector_norm(grads[name] - g)
        assert err <= bound * torch.linalg.vector_norm(g), f"{name}: |g - g_fp32| = {err:.3g} > {bound:.3g} |g_fp32|"
        # Spelled out: a stage whose gradients were lost shows up as zeros, whatever the tolerance.
        assert grads[name].count_nonzero() > 0 or g.count_nonzero() == 0, f"{name}: all-zero gradient"


def test_uploads_in_flight_are_awaited_before_use_and_before_freeing():
    # The CPU stand-in of CUDA devices hands out futures for uploads, as CUDA devices do.
    from mobius_fx.runtime.device_virtual_async import VirtualAsyncDevice

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    x = torch.randn(8, 8)
    devices = {g: VirtualAsyncDevice(g, None, seed=i) for i, g in enumerate(("gpu0", "gpu1"))}
    gm = fx.symbolic_trace(model)
    pipe = build_pipeline(model, gm, stage_nodes=cut(gm, 4), stage_gpus=["gpu0", "gpu1"] * 2, microbatches=1,
                          example_inputs=(x,), device=devices)
    assert pipe.devices == devices
    for _ in range(2):
        assert_same_step(step(eager, eager, x), step(pipe, model, x))
    for (name, b), ref in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, ref, msg=lambda m: f"{name}: {m}")
    assert all_freed(pipe)


def test_a_stage_that_changes_its_input_in_place_is_reported_in_backward():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = self.a(x)
            return self.b(h.mul_(2))  # in place on the next stage's input

    model = Net()
    x = torch.randn(4, 8)
    pipe = pipeline(model, x, stages=2, gpus=2, at=[1])
    with pytest.raises(MobiusError, match="modified in place after the forward used it"):
        pipe(x).sum().backward()
    assert all_freed(pipe)


def test_inputs_that_require_grad_get_the_eager_gradient():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=3, d_out=4)
    x = torch.randn(6, 8, requires_grad=True)
    pipe = pipeline(model, x.detach(), stages=3, gpus=2, microbatches=3)
    model(x).pow(2).sum().backward()
    eager, x.grad = x.grad.clone(), None
    pipe(x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, eager)


def expected_transfers(schedule, steps: int = 1) -> dict[str, dict[str, dict[str, int]]]:
    """Per GPU, the weight and gradient copies of a training step the schedule implies (all
    weights trainable parameters). Activations and saved inputs are checked copy by copy
    against the schedule IR in tests/unit/test_schedule_ir.py.

    - weight h2d: forward uploads every stage of the GPU once; `hold_for_backward` keeps the
      GPU's last stage resident, so backward uploads all the others again: S_g + (S_g - 1)
      stages per GPU, S + (S - N) in all; one copy per weight tensor.
    - gradient d2h: each stage's summed weight gradients go down once, one copy per tensor.
    """
    out: dict[str, dict[str, dict[str, int]]] = {}
    for gpu in schedule.gpus:
        mine = [st for st in schedule.stages if st.gpu == gpu]
        fetched = mine + [st for st in mine if not schedule.last_on_gpu(st.index)]
        kinds = {
            "weight h2d": (sum(len(st.weights) for st in fetched),
                           sum(nbytes(w.tensor) for st in fetched for w in st.weights)),
            "gradient d2h": (sum(len(st.weights) for st in mine),
                             sum(nbytes(w.tensor) for st in mine for w in st.weights)),
        }
        out[gpu] = {kind: {"count": steps * n, "bytes": steps * b} for kind, (n, b) in kinds.items() if n}
    return out


@pytest.mark.parametrize("stage_gpus", [["gpu0", "gpu1"] * 2, ["gpu1", "gpu0", "gpu2"] * 2 + ["gpu1"],
                                        ["gpu0"] * 3])
def test_transfer_stats_of_the_last_step_count_one_forward_and_backward(stage_gpus):
    model = ResidualMLP(d_in=8, width=16, depth=6, d_out=4)
    x = torch.randn(4, 8)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    adds = [j + 1 for j, n in enumerate(names) if n.startswith("add")][:len(stage_gpus) - 1]
    pipe = build_pipeline(model, gm, stage_nodes=cut(gm, at=adds), stage_gpus=stage_gpus, gpu_budgets={},
                          microbatches=2, example_inputs=(x,), device="virtual")
    for _ in range(3):
        pipe(x).sum().backward()
    expected = expected_transfers(pipe.schedule)
    for stats in (pipe.transfer_stats(last_step=True), pipe.transfer_stats()):
        assert stats.keys() == expected.keys()
        for gpu, kinds in expected.items():
            for kind, want in kinds.items():
                assert stats[gpu][kind] == want, f"{gpu} {kind}: {stats[gpu][kind]} != {want}"
        expected = expected_transfers(pipe.schedule, steps=3)  # then the whole history: three steps

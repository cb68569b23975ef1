"""The acceptance matrix of the step executor on the CPU (issue 37, Deliver 2): every registered
schedule the runtime runs trains the zoo's GPT and tiny Hugging Face GPT-2, Llama and T5 (called
with `labels=`) on `virtual-async` with seeded random delays, and

- `pipe.train_step` returns eager's loss and leaves eager's `.grad` on every master (the
  tolerances of tests/unit/test_train_step.py);
- the runtime moves exactly what the schedule's IR says, copy by copy, and executes the IR's
  order (tests/unit/test_executor.py `_check_conforms`).

The schedules are read from the registry when the tests are collected: one made runnable later
(registered with `runtime=`) joins the matrix by itself; those without a runtime form are
skipped with their reason. Graphs are traced once per model (a module-wide trace cache): the
matrix tests the schedules, not the tracing.

GPipe's runtime form (`planning.ir_resident.resident`) is checked for what makes it GPipe:
each stage's weights uploaded once per step and all the stages of a GPU resident at once.
"""

from collections import Counter, defaultdict

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import Topology, schedules
from mobius_fx.planning.ir_resident import resident
from mobius_fx.planning.schedule_ir import StageInput, StageIO, build_schedule
from mobius_fx.zoo import GPT, GPTConfig
from mobius_fx.zoo.tiny_hf import hf_gpt2, hf_llama, hf_t5
from tests.unit.test_executor import _check_conforms, _devices, _step_ir
from tests.unit.test_train_step import Classifier, _assert_grads_equal, _grads

pytestmark = pytest.mark.usefixtures("one_thread")

# Two root complexes: "mobius-identity-map" maps differently from Mobius's own cross map.
TOPO = Topology.virtual(gpus=2, memory="64MiB", root_complexes=2)
VOCAB = 64


def _lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# name -> (the model, its call for a batch of token ids: (args, kwargs) with the target or labels,
# its loss_fn (None: the model's own loss, HF's `labels=`))
MODELS = {
    "zoo-gpt": (lambda: GPT(GPTConfig(vocab=VOCAB, seq=8, hidden=16, blocks=2, heads=2)),
                lambda ids: ((ids,), {"target": ids}), _lm_loss),
    "hf-gpt2": (lambda: hf_gpt2(layers=2, vocab=VOCAB, positions=8),  # fp32: bf16 GPT-2 fails on the CPU
                lambda ids: ((ids,), {"labels": ids}), None),
    "hf-llama": (lambda: hf_llama(layers=1, vocab=VOCAB, positions=8),
                 lambda ids: ((ids,), {"labels": ids}), None),
    "hf-t5": (lambda: hf_t5(layers=1, vocab=VOCAB),
              lambda ids: ((), {"input_ids": ids, "labels": ids}), None),
}


@pytest.fixture(scope="module")
def trace_cache(tmp_path_factory):
    """A trace cache for this module: each model (and its step) is traced and costed once, and
    every schedule's compile reuses it (tests/conftest.py turns the cache off elsewhere)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOBIUS_FX_TRACE_CACHE", "1")
        yield str(tmp_path_factory.mktemp("mobius_cache"))


def _compile(model, args, kwargs, loss_fn, name, cache_dir, seed=3, topo=TOPO, **kw):
    call = {k: v for k, v in kwargs.items() if k != "target"}  # the model's own call (labels= included)
    return mobius_fx.compile(model, topo, example_inputs=args, example_kwargs=call or None, microbatches=2,
                             verbose=False, costs="model", cache_dir=cache_dir, device=_devices(seed),
                             loss_fn=loss_fn, schedule=name, **kw)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", schedules.names())
def test_every_runnable_schedule_trains_each_model_as_eager_does_and_runs_its_ir(name, model_name, trace_cache):
    entry = schedules.get(name)
    if not entry.runnable:
        pytest.skip(f"schedule {name!r} runs in the simulator only: "
                    f"{entry.refusal or 'it has no runtime form (registered without runtime=)'}")
    build, call, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, VOCAB, (4, 8))
    args, kwargs = call(ids)
    pipe = _compile(model, args, kwargs, loss_fn, name, trace_cache)
    loss = pipe.train_step(*args, **kwargs)
    got = _grads(model)
    model.zero_grad()
    ref = loss_fn(model(*args), ids) if loss_fn is not None else model(*args, **kwargs).loss
    ref.backward()
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads_equal(got, _grads(model))
    sp = pipe.step_pipeline
    assert sp._rt._step_executor.name == name
    assert sp.plan.num_stages >= 2
    _check_conforms(pipe, _step_ir(pipe, name, args, kwargs))


def test_the_matrix_covers_every_registered_schedule():
    """The matrix reads the registry: it runs at least Mobius's own schedule and GPipe's resident one."""
    runnable = [n for n in schedules.names() if schedules.get(n).runnable]
    assert {"mobius", "gpipe"} <= set(runnable)


def test_gpipe_uploads_each_stage_once_and_holds_every_stage_of_a_gpu(trace_cache):
    """Three stages per GPU: Mobius streams them through two weight slots and uploads each again
    for its backward; GPipe's runtime form holds all three from their forward upload to their
    backward evict, in a slot pool of three planned from its IR (nothing allocated beyond it)."""
    uploads, peak, slots = {}, {}, {}
    for name in ("mobius", "gpipe"):
        torch.manual_seed(0)
        model = Classifier(blocks=5)
        x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
        pipe = _compile(model, (x,), {"target": y}, F.cross_entropy, name, trace_cache, cuts=[1, 2, 3, 4, 5])
        loss = pipe.train_step(x, target=y)
        got = _grads(model)
        model.zero_grad()
        ref = F.cross_entropy(model(x), y)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
        _assert_grads_equal(got, _grads(model))
        sp = pipe.step_pipeline
        _check_conforms(pipe, _step_ir(pipe, name, (x,), {"target": y}))
        uploads[name] = Counter(k for kind, _, k, _, _ in sp.executed_ops() if kind == "prefetch")
        on, most = defaultdict(set), defaultdict(int)
        for kind, gpu, k, _, _ in sp.executed_ops():
            if kind == "prefetch":
                on[gpu].add(k)
            elif kind == "evict":
                on[gpu].discard(k)
            most[gpu] = max(most[gpu], len(on[gpu]))
        peak[name] = dict(most)
        slots[name] = {g: d.slot_stats() for g, d in sp._rt.devices.items()}
    stages = len(uploads["gpipe"])
    assert stages == 6
    assert uploads["gpipe"] == {k: 1 for k in range(stages)}  # once per step
    assert sum(uploads["mobius"].values()) > stages  # Mobius uploads the evicted stages again for backward
    assert peak["gpipe"] == {"gpu0": 3, "gpu1": 3} and max(peak["mobius"].values()) == 2
    assert all(s["slots"] >= 3 and s["overflows"] == 0 for s in slots["gpipe"].values()), slots["gpipe"]


def test_resident_holds_each_stage_from_its_upload_to_its_backward_and_moves_the_same_values():
    """`resident` on a built IR: the runs and the activation, input and gradient copies are the
    Mobius IR's; each stage with a backward is uploaded once and held (a frozen stage without
    one is still evicted after its forward), so a GPU holds all its trained stages at once."""
    stages = [StageIO("gpu0", 100, 0, (StageInput(-1, 8, needs_grad=False),)),  # frozen: no backward
              StageIO("gpu1", 200, 200, (StageInput(0, 8),)),
              StageIO("gpu0", 300, 300, (StageInput(1, 8),)),
              StageIO("gpu1", 400, 400, (StageInput(2, 8), StageInput(0, 8))),
              StageIO("gpu0", 500, 500, (StageInput(3, 8),), host_outputs=(4,))]
    ir = build_schedule(stages, microbatches=3)
    r = resident(ir)
    assert all(d < o.index for o in r.ops for d in o.deps)
    runs = lambda x: [(o.place, o.stage, o.phase, o.microbatch) for o in x.ops if o.kind == "run"]  # noqa: E731
    assert runs(r) == runs(ir)
    moved = lambda x: {k: v for k, v in x.bytes_moved().items() if k[1] != "weight"}  # noqa: E731
    assert moved(r) == moved(ir)
    assert {k: v for k, v in r.bytes_moved().items() if k[1] == "weight"} == {
        (st.gpu, "weight", "h2d", k): (1, st.weight_bytes) for k, st in enumerate(stages)}
    assert not r.select(kind="prefetch", phase="backward")
    assert [o.stage for o in r.select(kind="hold")] == [1, 2, 3, 4]
    assert [o.stage for o in r.select(kind="evict", phase="forward")] == [0]
    assert [o.stage for o in r.select(kind="evict", phase="backward")] == [4, 3, 2, 1]
    assert r.resident_at_most() == {"gpu0": 2, "gpu1": 2} and ir.resident_at_most() == {"gpu0": 2, "gpu1": 2}
    upload = {o.stage: o.index for o in r.select(kind="prefetch")}
    assert all(o.deps == (upload[o.stage],) for o in r.select(kind="wait", phase="backward"))
    assert resident(r).ops == r.ops  # nothing left to hold

"""The trace cache (mobius_fx/compile_cache.py, trace_key.py, trace_store.py): a warm compile is
the cold one (same plan, same losses and gradients, against eager too), bound to the new model's
own tensors; a changed model, input or setting misses; a corrupt entry is retraced, with a log line."""

import copy
import functools
import importlib
import logging
import sys

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import Topology, trace
from mobius_fx.trace_key import trace_key
from mobius_fx.zoo import hf_inputs, hf_llama
from mobius_fx.zoo.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TOPO = Topology.virtual(gpus=2, memory="64MiB")


@pytest.fixture(autouse=True)
def cache_on(monkeypatch):
    """tests/conftest.py turns the trace cache off for the suite; these tests are about it."""
    monkeypatch.setenv("MOBIUS_FX_TRACE_CACHE", "1")


def _gpt(hidden=32, blocks=2):
    """A GPT (tied head) that torch.fx.symbolic_trace captures, and token ids."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden=hidden, blocks=blocks, heads=2, seq=16, vocab=64))
    return model, (torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)),)


def _llama():
    torch.manual_seed(0)
    model = hf_llama(layers=1)
    return model, hf_inputs(model, batch=4, seq=8)


def _step(pipe_or_model, inputs):
    out = pipe_or_model(*inputs)
    logits = out.logits if hasattr(out, "logits") else out
    loss = logits.float().pow(2).mean()
    loss.backward()
    return logits.detach(), loss.detach()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build, front_end", [(_gpt, "fx"), (_llama, "export")], ids=["fx", "export"])
def test_a_warm_compile_is_the_cold_one_bound_to_the_new_models_tensors(build, front_end, tmp_path, caplog):
    model, inputs = build()
    eager = copy.deepcopy(model)
    resumed = copy.deepcopy(model)  # a new process: the same model, other tensor objects
    kw = dict(example_inputs=inputs, microbatches=2, cache_dir=str(tmp_path), verbose=False, device="virtual",
              costs="model")  # measured costs are measured anew each compile: not cached
    with caplog.at_level(logging.INFO, logger="mobius_fx"):
        cold = mobius_fx.compile(model, TOPO, **kw)
        assert not any("trace: cached" in r.message for r in caplog.records)
        caplog.clear()
        warm = mobius_fx.compile(resumed, TOPO, **kw)
    messages = [r.message for r in caplog.records]
    assert any(m.startswith("trace: cached (key ") for m in messages), messages
    assert any(m.startswith("annotate: cached (key ") for m in messages), messages
    assert not any("traced " in m for m in messages), messages
    assert str(warm.plan).replace(", cached)", ")") == str(cold.plan)  # the solver's line says the cuts were cached
    assert warm._gm.meta["mobius_trace"].front_end == front_end and warm._gm.meta["mobius_trace"].cached
    # the warm graph reads the resumed model's own tensors, never the cold model's
    warm_ids = {id(t) for t in [*warm._gm.parameters(), *warm._gm.buffers()]}
    assert warm_ids <= {id(t) for t in [*resumed.parameters(), *resumed.buffers()]}
    assert warm._gm.code == cold._gm.code
    assert _facts(warm._gm) == _facts(cold._gm)  # what the later passes and the runtime read of each node
    assert getattr(warm._gm, "range_constraints", None) == getattr(cold._gm, "range_constraints", None)
    c_logits, c_loss = _step(cold, inputs)
    w_logits, w_loss = _step(warm, inputs)
    e_logits, e_loss = _step(eager, inputs)
    assert torch.equal(w_logits, c_logits) and torch.equal(w_loss, c_loss)  # the same program: bit for bit
    cold_grads, warm_grads, eager_grads = _grads(model), _grads(resumed), _grads(eager)
    assert warm_grads.keys() == cold_grads.keys() == eager_grads.keys()
    for name in cold_grads:
        assert torch.equal(warm_grads[name], cold_grads[name]), name
        torch.testing.assert_close(warm_grads[name], eager_grads[name], msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(w_logits, e_logits)  # torch's float32 tolerances: micro-batches sum in another order
    torch.testing.assert_close(w_loss, e_loss)


def _dtypes(val):
    if hasattr(val, "dtype"):  # a tensor, or TensorMetadata (a named tuple)
        return val.dtype
    if isinstance(val, (tuple, list)):
        return tuple(_dtypes(v) for v in val)
    return getattr(val, "dtype", None)


def _facts(gm):
    """Per node: name, op, target, module path, output dtypes; a placeholder's traced shape."""
    from mobius_fx.module_paths import module_path

    return [(n.name, n.op, str(n.target), module_path(n), _dtypes(n.meta.get("val", n.meta.get("tensor_meta"))),
             str(n.meta.get("val")) if n.op == "placeholder" else None) for n in gm.graph.nodes]


def _key(model, inputs, **kw):
    return trace_key(model, inputs, {}, front_end=kw.get("front_end", "auto"), dynamic_batch=kw.get("dynamic", True))


def test_the_key_changes_with_the_model_its_inputs_and_the_trace_settings():
    model, (idx,) = _gpt()
    base = _key(model, (idx,))
    assert _key(copy.deepcopy(model), (idx,)) == base  # same structure, other tensors: a hit
    assert _key(_gpt()[0], (idx,)) == base
    assert _key(_gpt(hidden=48)[0], (idx,)) != base  # another layer width
    assert _key(_gpt(blocks=3)[0], (idx,)) != base  # another depth
    assert _key(model, (idx[:2],)) != base  # another batch
    assert _key(model, (idx[:, :4],)) != base  # another sequence length
    assert _key(model, (idx.int(),)) != base  # another dtype
    assert _key(model, (idx,), front_end="export") != base
    assert _key(model, (idx,), dynamic=False) != base
    half = copy.deepcopy(model).half()
    assert _key(half, (idx,)) != base  # parameter dtypes
    frozen = copy.deepcopy(model)
    frozen.wte.weight.requires_grad_(False)
    assert _key(frozen, (idx,)) != base
    evaluated = copy.deepcopy(model).eval()
    assert _key(evaluated, (idx,)) != base  # training flags (export bakes them in)
    untied = copy.deepcopy(model)
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    assert _key(untied, (idx,)) != base  # the tie between wte and lm_head
    dropped = copy.deepcopy(model)
    dropped.h[0].attn.dropout = 0.1
    assert _key(dropped, (idx,)) != base  # a module's plain attribute, read in forward


class _Mixer(nn.Module):
    """Holds a function it calls in forward (test_microbatch_semantics' row mixers are such)."""

    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x))


def _scaled(factor):
    return lambda t: t * factor


def test_a_function_the_model_holds_is_in_the_key():
    """Two models of one class that differ only by the function they hold are two traces: a
    function's code, its defaults and what it closes over are keyed (a stale graph otherwise)."""
    x = torch.randn(3, 4)
    key = lambda fn: _key(_Mixer(fn), (x,))  # noqa: E731
    assert key(torch.relu) == key(torch.relu) != key(torch.tanh)  # library functions by name
    assert key(lambda t: t.flip(0)) != key(lambda t: t.sum(0, keepdim=True).expand_as(t))  # other code
    assert key(_scaled(2.0)) == key(_scaled(2.0)) != key(_scaled(3.0))  # same code, another closure value
    assert key(functools.partial(torch.roll, shifts=1, dims=0)) != key(functools.partial(torch.roll, shifts=2,
                                                                                             dims=0))

    class Scale:  # a callable object: its class and its simple attributes
        def __init__(self, k):
            self.k = k

        def __call__(self, t):
            return t * self.k

    assert key(Scale(2)) == key(Scale(2)) != key(Scale(3))
    assert key(Scale(2).__call__) != key(Scale(3).__call__)  # a bound method: the object it is bound to
    w2, w3 = torch.full((4,), 2.0), torch.full((4,), 3.0)
    assert key(_scaled(w2)) == key(_scaled(w2.clone())) != key(_scaled(w3))  # a tensor closed over: its values
    assert key(lambda t, w=w2: t * w) != key(lambda t, w=w3: t * w)  # a tensor default
    assert key(lambda t, a=torch.relu: a(t)) != key(lambda t, a=torch.tanh: a(t))  # a function default
    assert key(functools.partial(torch.mul, other=w2)) != key(functools.partial(torch.mul, other=w3))
    assert key(lambda t: (lambda u: u * 2)(t)) != key(lambda t: (lambda u: u * 3)(t))  # a nested function's constant

    def kw(t, *, s=2.0):
        return t * s

    k2 = key(kw)
    kw.__kwdefaults__ = {"s": 3.0}
    assert key(kw) != k2  # a keyword-only default


def test_another_forward_in_the_models_source_misses(tmp_path, monkeypatch):
    source = tmp_path / "cache_probe_model.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    body = ("import torch\nfrom torch import nn\n\nclass Probe(nn.Module):\n    def __init__(self):\n"
            "        super().__init__()\n        self.lin = nn.Linear(4, 4)\n\n    def forward(self, x):\n"
            "        return {}\n")
    x = torch.randn(2, 4)
    keys = []
    for expr in ("self.lin(x).relu()", "self.lin(x).tanh()"):
        source.write_text(body.format(expr))
        sys.modules.pop("cache_probe_model", None)
        importlib.invalidate_caches()
        keys.append(_key(importlib.import_module("cache_probe_model").Probe(), (x,)))
    assert keys[0] != keys[1]


def test_a_corrupt_entry_is_traced_again_with_a_log_line_and_rewritten(tmp_path, caplog):
    model, inputs = _gpt()
    first = trace(model, example_inputs=inputs, cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.graph")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # truncated, as by a full disk
    with caplog.at_level(logging.INFO, logger="mobius_fx"):
        again = trace(model, example_inputs=inputs, cache_dir=tmp_path)
    assert any(r.levelno == logging.WARNING and "ignoring the cached graph" in r.message for r in caplog.records)
    assert not again.meta["mobius_trace"].cached and again.code == first.code
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mobius_fx"):
        third = trace(model, example_inputs=inputs, cache_dir=tmp_path)  # the entry was written anew
    assert third.meta["mobius_trace"].cached
    assert any(r.message.startswith("trace: cached") for r in caplog.records)


def test_an_entry_that_binds_otherwise_is_not_trusted(tmp_path, caplog):
    model, inputs = _gpt()
    trace(model, example_inputs=inputs, cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.graph")
    other = tmp_path / "other"
    other.mkdir()
    key = _key(model, inputs)
    assert entry.stem == key
    # an entry stored for this key whose stored binding names another parameter: refused, retraced
    import pickle

    data = pickle.loads(entry.read_bytes())
    names = data["info"]["names"]
    a, b = sorted(n for n in names if n.endswith("weight"))[:2]
    names[a], names[b] = names[b], names[a]
    entry.write_bytes(pickle.dumps(data))
    with caplog.at_level(logging.INFO, logger="mobius_fx"):
        again = trace(model, example_inputs=inputs, cache_dir=tmp_path)
    assert not again.meta["mobius_trace"].cached
    assert any("ignoring the cached graph" in r.message for r in caplog.records)


def test_the_cache_is_off_with_cache_false_or_the_environment(tmp_path, monkeypatch):
    model, inputs = _gpt()
    kw = dict(example_inputs=inputs, microbatches=2, cache_dir=str(tmp_path), verbose=False, costs="model")
    mobius_fx.plan(model, TOPO, cache=False, **kw)
    assert not (tmp_path / "traces").exists()
    monkeypatch.setenv("MOBIUS_FX_TRACE_CACHE", "0")
    mobius_fx.plan(model, TOPO, **kw)
    assert not (tmp_path / "traces").exists()
    monkeypatch.setenv("MOBIUS_FX_TRACE_CACHE", "1")
    mobius_fx.plan(model, TOPO, **kw)
    assert len(list((tmp_path / "traces").glob("*.graph"))) == 1
    assert len(list((tmp_path / "traces").glob("*.layers"))) == 1
    with pytest.raises(mobius_fx.MobiusError, match="cache="):
        mobius_fx.plan(model, TOPO, cache="yes", **kw)


def test_layer_costs_are_keyed_by_the_cost_settings(tmp_path):
    model, inputs = _gpt()
    kw = dict(example_inputs=inputs, microbatches=2, cache_dir=str(tmp_path), verbose=False, costs="model")
    a = mobius_fx.plan(model, TOPO, **kw)
    b = mobius_fx.plan(model, TOPO, dtype=torch.bfloat16, **kw)
    assert len(list((tmp_path / "traces").glob("*.graph"))) == 1  # one graph
    assert len(list((tmp_path / "traces").glob("*.layers"))) == 2  # another streamed dtype: other costs
    assert a.layers != b.layers  # bf16 activations: other saved bytes
    c = mobius_fx.plan(model, TOPO, dtype=torch.bfloat16, **kw)
    assert c.layers == b.layers


def test_a_restored_export_graph_keeps_its_modes_fixed(tmp_path):
    model, inputs = _llama()
    cold = trace(model, example_inputs=inputs, cache_dir=tmp_path)
    warm = trace(copy.deepcopy(model), example_inputs=inputs, cache_dir=tmp_path)
    assert warm.meta["mobius_trace"].cached and warm.meta["mobius_trace"].modes == cold.meta["mobius_trace"].modes
    for gm in (cold, warm):
        with pytest.raises(NotImplementedError):
            gm.eval()

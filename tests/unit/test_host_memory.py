"""The host's memory, planned (issue 40 part 2): the topology says the host's DRAM (JSON, presets,
detected), the plan counts everything a step keeps in host memory term by term, and plan, compile
and the CLI refuse a plan the host does not hold, naming the remedies."""

import dataclasses
import json
import sys

import pytest
import torch
import torch.nn as nn

import mobius_fx
from mobius_fx import PlanError, Topology
from mobius_fx.errors import MobiusError, TopologyError
from mobius_fx.options import CompileOptions
from mobius_fx.planning.host_memory import OPTIMIZER_STATE, HostBudget
from mobius_fx.planning.plans import Plan
from mobius_fx.topology import detect
from mobius_fx.topology.schema import HostFigures

GiB = 2**30
BASE = {"name": "t", "nodes": [{"name": "cpu0", "kind": "root_complex"},
                               {"name": "gpu0", "kind": "gpu", "memory": "8GiB", "spec": "h200"}],
        "links": [{"a": "cpu0", "b": "gpu0", "bandwidth_gbps": 25}]}


def _mlp(width=64, depth=4):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])


# ------------------------------------------------------------------ the topology's DRAM
def test_the_json_host_memory_round_trips_apart_from_the_measured_figures(tmp_path):
    topo = Topology.from_dict({**BASE, "host": {"memory": "256GiB"}})
    assert topo.host_memory == 256 * GiB and topo.host is None  # not a measured figure
    path = tmp_path / "t.json"
    path.write_text(topo.to_json())
    back = Topology.from_json(path)
    assert back == topo and back.to_dict()["host"] == {"memory": 256 * GiB}
    assert back != Topology.from_dict(BASE) and Topology.from_dict(BASE).host_memory is None
    both = Topology.from_dict({**BASE, "host": {"memory": 2**37, "cores": 16}})
    assert both.host == HostFigures(cores=16) and both.host_memory == 2**37
    assert both.with_host(HostFigures(cores=2)).host_memory == 2**37  # measured figures replaced, DRAM kept
    assert topo.with_host_memory("1TiB").host_memory == 2**40 and "host memory 256.00 GiB" in topo.tree()


@pytest.mark.parametrize("memory, says", [(0, "memory is 0 bytes"), (256, "memory is 256 bytes"),
                                          ("lots", "memory"), (-1, "negative"), (True, "memory")])
def test_a_bad_host_memory_is_refused_at_its_json_location(memory, says):
    with pytest.raises(TopologyError) as e:
        Topology.from_dict({**BASE, "host": {"memory": memory}}, source="server.json")
    assert str(e.value).startswith("server.json: host") and says in str(e.value)


def test_presets_say_their_hosts_dram():
    assert Topology.preset("mobius-testbed").host_memory == 384 * GiB
    assert Topology.preset("rtx4090x8").host_memory == 800 * 10**9  # the RoundPipe paper's 800 GB
    assert Topology.preset("v100x4-nvlink").host_memory == 244 * GiB  # p3.8xlarge
    assert Topology.preset("single-3090").host_memory == 128 * GiB


def test_virtual_topologies_take_this_machines_dram_or_the_given_one():
    assert Topology.virtual(gpus=2).host_memory == detect.host_memory_bytes()
    assert Topology.virtual(gpus=2, host_memory="64GiB").host_memory == 64 * GiB
    assert Topology.virtual(gpus=2, host_memory=None).host_memory is None


def test_host_memory_is_read_from_proc_meminfo_without_psutil(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       263856132 kB\nMemFree:         1000 kB\n")
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    assert detect.host_memory_bytes(str(meminfo)) == 263856132 * 1024
    assert detect.host_memory_bytes(str(tmp_path / "missing")) is None


# ------------------------------------------------------------------ the budget
@pytest.mark.parametrize("dtype", [torch.float16, None])
def test_the_budget_counts_each_term_of_the_model(dtype, tmp_path):
    model = _mlp()
    params = sum(p.numel() for p in model.parameters())
    model[0].requires_grad_(False)  # frozen: a master, streamed, but no gradient nor state
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = mobius_fx.plan(model, Topology.virtual(gpus=2, memory="256KiB", host_memory="1GiB"),
                          example_inputs=(torch.randn(8, 64),), microbatches=2, dtype=dtype, verbose=False)
    b = plan.host_budget()
    stream = 2 if dtype is not None else 4
    assert (b.masters, b.grads, b.optimizer_state) == (4 * params, 4 * trainable, 2 * 4 * trainable)
    assert b.streamed_copy == stream * params
    assert b.grad_downloads == (stream * trainable if dtype is not None else 0)  # fp32 streamed: the download is .grad
    held = sum(o.bytes for o in plan.schedule().ops if o.phase == "forward" and o.dst == "host")
    assert b.activations == held > 0 and b.limit == GiB
    assert b.total == b.masters + b.grads + b.grad_downloads + b.optimizer_state + b.streamed_copy + b.activations \
        + b.pinned_buffers
    for opt, factor in OPTIMIZER_STATE.items():
        assert plan.host_budget(opt).optimizer_state == factor * 4 * trainable
    line = plan.host_memory()
    assert line.startswith("host memory: ") and "needed of 1.00 GiB" in line and "AdamW state" in line


def test_the_optimizer_is_a_checked_option_carried_by_the_plan(tmp_path):
    with pytest.raises(MobiusError, match="optimizer='lion'.*'adamw'.*8-bit"):
        CompileOptions(optimizer="lion")
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(MobiusError, match="host_memory_fraction"):
            CompileOptions(host_memory_fraction=bad)
    plan = mobius_fx.plan(_mlp(), Topology.virtual(gpus=2, memory="256KiB"), example_inputs=(torch.randn(8, 64),),
                          optimizer="sgd", verbose=False)
    assert plan.optimizer == "sgd" and plan.host_budget().optimizer_state == 0 and "SGD: no state" in str(plan)
    assert Plan.from_json(plan.to_json()).optimizer == "sgd"


# ------------------------------------------------------------------ the rule
def test_plan_and_compile_refuse_a_host_that_does_not_hold_the_step():
    kw = dict(example_inputs=(torch.randn(8, 256),), microbatches=2, cuts=[2], verbose=False)  # one partition
    need = mobius_fx.plan(_mlp(256), Topology.virtual(gpus=2, memory="4MiB", host_memory=None),
                          **kw).host_budget().total
    assert need > 2**20  # a host memory of at least 1 MiB can be too small for it
    small = Topology.virtual(gpus=2, memory="4MiB", host_memory=need)  # 90% of what it needs
    for entry in (mobius_fx.plan, mobius_fx.compile):
        with pytest.raises(PlanError) as e:
            entry(_mlp(256), small, **kw)
        msg = str(e.value)
        for says in ("host memory: ", "over 90%", "host_memory_fraction=0.9",
                     "bf16 masters", "LoRA", "optimizer='sgd-momentum'", "a host with at least",
                     "host_memory_fraction=None"):
            assert says in msg, (says, msg)
    assert mobius_fx.plan(_mlp(256), small, host_memory_fraction=None, **kw).host_budget().total == need
    assert mobius_fx.plan(_mlp(256), small, host_memory_fraction=1.0, **kw)  # up to all of it: it fits exactly


def test_the_rule_is_the_fraction_of_the_hosts_dram_exactly():
    b = HostBudget("adamw", masters=400, grads=400, grad_downloads=0, optimizer_state=800, streamed_copy=200,
                   activations=150, pinned_buffers=50, limit=2000)  # 2000 bytes in all
    b.check(1.0)
    b.check(None)
    dataclasses.replace(b, limit=None).check(0.5)  # unknown DRAM refuses nothing
    with pytest.raises(PlanError, match="over 99%") as e:
        b.check(0.99, microbatches=4)
    assert "a smaller batch" not in str(e.value)  # activations are 7.5% of it
    with pytest.raises(PlanError, match="a smaller batch or shorter sequences .* in 4 micro-batches"):
        dataclasses.replace(b, activations=5000).check(0.99, microbatches=4)
    fine = b.bf16_masters()
    assert (fine.masters, fine.grads, fine.optimizer_state, fine.streamed_copy) == (200, 200, 400, 200)


# ------------------------------------------------------------------ 70B, reduced
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "hidden_act": "silu",
             "tie_word_embeddings": False}


def test_llama_70b_arithmetic_on_one_layer_refuses_256_gib_at_80(tmp_path):
    """The 70B config with 1 decoder layer is planned (tracing 80 takes minutes); the budget is its
    parameters' bytes, and the 80-layer budget (the 79 missing layers added term by term) is refused
    on a 256 GiB host, naming the remedies."""
    from mobius_fx import zoo

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_70B, "num_hidden_layers": 1}))
    model, inputs = zoo.build(str(tmp_path), batch=2, seq=16, device="meta")  # the directory holding config.json
    assert next(model.parameters()).dtype == torch.float32  # fp32 masters whatever the config's torch_dtype
    params = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    plan = mobius_fx.plan(model, Topology.preset("rtx4090x8").with_host_memory("256GiB"), example_inputs=inputs,
                          dtype=torch.float16, time_limit=2, verbose=False)  # streamed in fp16, as the CLI does
    b = plan.host_budget()
    assert (b.masters, b.grads, b.optimizer_state, b.streamed_copy, b.grad_downloads) == (
        4 * params, 4 * params, 8 * params, 2 * params, 2 * params)
    more = 79 * layer
    full = dataclasses.replace(b, masters=b.masters + 4 * more, grads=b.grads + 4 * more,
                               grad_downloads=b.grad_downloads + 2 * more, optimizer_state=b.optimizer_state + 8 * more,
                               streamed_copy=b.streamed_copy + 2 * more)
    assert 70.5e9 < params + more < 70.6e9  # Llama-3-70B's parameters
    with pytest.raises(PlanError) as e:
        full.check(0.9)
    for says in ("needed of 256.00 GiB", "bf16 masters", "LoRA with peft", "LoRA on bf16 masters"):
        assert says in str(e.value)


# ------------------------------------------------------------------ the CLI
TINY_LLAMA = {**LLAMA_70B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}


def test_the_cli_plans_a_config_json_prints_the_host_line_and_refuses_a_small_host(tmp_path, capsys):
    from mobius_fx.__main__ import _parser, main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    server = tmp_path / "server.json"
    server.write_text(json.dumps({**BASE, "host": {"memory": "1MiB"}}))
    argv = ["plan", "--model", str(config), "--batch", "2", "--seq", "16", "--time-limit", "2", "--quiet"]
    assert main(argv + ["--topology", "single-3090", "--optimizer", "sgd", "--master-dtype", "bf16",
                        "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "host memory: " in out and "needed of 128.00 GiB" in out and "SGD: no state" in out
    assert "bfloat16 (the masters' dtype)" in out and "streamed-dtype downloads" not in out
    assert main(argv + ["--topology", str(server)]) == 2  # fp32 masters, AdamW: refused
    err = capsys.readouterr().err
    assert "host memory: " in err and "needed of 1.00 MiB" in err and "AdamW state" in err
    assert "--master-dtype bf16" in err and "LoRA" in err and "--host-memory-fraction off" in err
    args = _parser().parse_args(argv + ["--topology", str(server), "--host-memory-fraction", "off"])
    assert args.host_memory_fraction is None and args.optimizer == "adamw"
    with pytest.raises(SystemExit):
        _parser().parse_args(argv + ["--topology", str(server), "--host-memory-fraction", "1.5"])


def test_a_factory_module_in_the_current_directory_is_found_as_a_console_script_would_not(tmp_path, monkeypatch):
    from mobius_fx import zoo

    (tmp_path / "my_models_hostmem.py").write_text(
        "import torch.nn as nn\n\ndef make(*, batch, seq, device):\n    return nn.Linear(4, 4)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # a console script's
    model, _ = zoo.build("my_models_hostmem:make", batch=2, seq=4)
    assert isinstance(model, nn.Linear) and str(tmp_path) not in sys.path  # the path is left as it was


def test_the_zoo_names_70b_models():
    from mobius_fx import zoo

    assert {"llama-70b", "qwen2.5-72b"} <= set(zoo.model_names())

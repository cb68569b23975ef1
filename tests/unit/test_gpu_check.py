"""benchmarks/gpu_check.py, the script prepared for a GPU machine, checked where there is none:
it says so and exits 0; its pure parts (model sizing, the topology JSON it writes, reading the
plan, the report) and its GPU phase's CPU-computable parts (plan and simulate on the meta
device; the same training and comparisons on virtual GPUs) work here."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mobius_fx
from mobius_fx import Topology

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
# The script's model, traced once for the module (tests/conftest.py): its dry runs and virtual runs
# compile the same model again and again; tracing is not what this checks (test_trace_cache.py does).
pytestmark = pytest.mark.usefixtures("trace_cache")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


gc = _load()


# ~20M parameters in 25 blocks of hidden 256: 38 MiB in bf16, planned through 16 MiB GPUs in ~2 s
SMALL = ("--params", "2e7", "--hidden", "256", "--vocab", "512", "--seq", "64", "--batch", "4", "--time-limit", "2")


def _args(*argv):
    return gc._parser().parse_args(list(argv))


def test_without_a_gpu_the_script_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even on a machine that has one
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert gc.NO_GPU in out.stdout
    assert "On a GPU it would" in out.stdout and "tests/gpu" in out.stdout and "--dry-run" in out.stdout


def test_help_documents_every_option_and_the_docstring_how_to_run_it(capsys):
    with pytest.raises(SystemExit) as e:
        gc.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = [a for a in gc._parser()._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 20
    for a in options:
        assert a.help and len(a.help) > 15, a.option_strings
        assert a.option_strings[0] in text
    assert "python benchmarks/gpu_check.py [--out DIR]" in gc.__doc__
    assert "[measured]" in gc.__doc__ and "[simulated]" in gc.__doc__ and "exits 0" in gc.__doc__


@pytest.mark.parametrize("params", [1e9, 3e9, 6e9])
def test_gpt_config_is_the_size_asked_for_in_heads_of_128(params):
    cfg = gc.gpt_config(params)
    n = gc.gpt_params(cfg.hidden, cfg.blocks, vocab=cfg.vocab, seq=cfg.seq)
    assert abs(n - params) <= 0.05 * params
    assert cfg.hidden % 128 == 0 and cfg.heads * 128 == cfg.hidden
    assert 0.5 <= cfg.hidden / 80 / cfg.blocks <= 2


def test_gpt_params_counts_what_the_model_holds():
    cfg = gc.gpt_config(3e9, hidden=256, blocks=3, vocab=1000, seq=64)
    assert (cfg.hidden, cfg.blocks) == (256, 3)  # given sizes are kept
    model, (idx, targets) = gc.build_model(cfg, batch=2, device="meta")
    held = sum(p.numel() for p in model.parameters())  # the tied head counted once
    assert held == gc.gpt_params(256, 3, vocab=1000, seq=64)
    assert idx.shape == targets.shape == (2, 64)


def test_machine_topology_round_trips_with_the_measured_bandwidths(tmp_path):
    links = [gc.LinkFigures(53.123456789e9, 49.87654321e9, 0.8312), gc.LinkFigures(26.2e9, 26.2e9, None)]
    d = gc.machine_topology_dict([("NVIDIA H200", 150_000_000_000), ("NVIDIA H200", 150_000_000_000)], links,
                                 spec="h200")
    topo = Topology.from_dict(d)
    path = tmp_path / "topology.json"
    path.write_text(topo.to_json())
    back = Topology.from_json(path)
    assert back == topo
    for i, bw in enumerate(links):
        g = f"gpu{i}"
        assert back.route("host", g) == ("cpu0", g)
        assert back.bandwidth("host", g) == pytest.approx(bw.h2d, abs=1)
        assert back.bandwidth(g, "host") == pytest.approx(bw.d2h, abs=1)
        assert back.gpu(g).memory == 150_000_000_000 and back.gpu(g).spec.name == "h200" and back.gpu(g).index == i
    assert back.link_duplex("cpu0", "gpu0") == pytest.approx(0.8312)
    assert back.link_duplex("cpu0", "gpu1") == 1.0  # not measured: the library's default straight at a socket


def test_budget_topology_puts_the_gpus_sharing_a_device_under_one_switch():
    bw = gc.LinkFigures(50e9, 40e9, 0.9)
    one = Topology.from_dict(gc.budget_topology_dict(2, 3 * 2**30, [bw], spec="h200"))
    assert [g.memory for g in one.gpus] == [3 * 2**30] * 2
    assert one.route("host", "gpu0") == ("cpu0", "sw0", "gpu0") and one.route("host", "gpu1") == ("cpu0", "sw0", "gpu1")
    assert one.link_bandwidth("cpu0", "sw0") == 50e9 and one.link_bandwidth("sw0", "cpu0") == 40e9
    assert one.link_duplex("cpu0", "sw0") == pytest.approx(0.9)
    three = Topology.from_dict(gc.budget_topology_dict(3, 2**30, [bw, bw], spec="h200"))
    assert three.route("host", "gpu2") == ("cpu0", "sw0", "gpu2") and three.route("host", "gpu1") == ("cpu0", "gpu1")
    assert gc.cuda_indices(3, 2) == [0, 1, 0] and gc.cuda_indices(2, 8) == [0, 1]


def test_spec_is_guessed_from_the_product_name_and_says_when_it_is_not():
    assert gc.spec_for("NVIDIA H200") == ("h200", True)
    assert gc.spec_for("NVIDIA GeForce RTX 3090 Ti") == ("rtx3090ti", True)
    assert gc.spec_for("NVIDIA B200")[1] is False


def test_the_plans_peak_is_the_double_buffer_of_consecutive_stages_on_a_gpu():
    # a stage's peak with the weights and boundary activations (M = 2 micro-batches) of the
    # next stage on its GPU (forward) or the one before it, and the next one's input gradients
    # (backward): step_model.memory_rows
    stages = [SimpleNamespace(gpu=g, peak_bytes=b, param_bytes=w, input_bytes=1, output_bytes=1) for g, b, w in
              [("gpu0", 5, 3), ("gpu1", 7, 1), ("gpu0", 9, 2), ("gpu1", 1, 1), ("gpu0", 2, 1), ("gpu2", 4, 1)]]
    got = gc.plan_gpu_peaks(SimpleNamespace(stages=stages, microbatches=2))
    # gpu0: stage 2 (9) + stage 0 held (3 + 4) + stage 4's input gradients (2); gpu1: 7 + (1 + 4)
    assert got == {"gpu0": 9 + 7 + 2, "gpu1": 7 + 5, "gpu2": 4}


def test_pytest_summary_counts():
    text = "....F.s\nFAILED tests/gpu/x.py::t - boom\n3 passed, 1 failed, 2 skipped, 1 error, 4 warnings in 4.2s\n"
    assert gc.parse_pytest_summary(text) == {"passed": 3, "failed": 1, "skipped": 2, "errors": 1, "xfailed": 0,
                                             "xpassed": 0}
    assert gc.parse_pytest_summary("sssss\n12 skipped in 0.5s")["skipped"] == 12
    assert set(gc.parse_pytest_summary("no tests ran in 0.01s").values()) == {0}


def test_ratio_is_measured_over_the_other_and_na_without_one():
    assert gc.ratio(3.0, 2.0) == "1.50x"
    assert gc.ratio(None, 2.0) == gc.ratio(2.0, 0) == gc.ratio(2.0, None) == "n/a"
    assert gc.fmt_params(2.65e9) == "2.65B" and gc.fmt_params(124.4e6) == "124.4M"


def _figures(**kw):
    base = dict(config=gc.gpt_config(3e9), params=3_000_000_000, topology="t", device="cuda",
                plan_summary="Mobius plan", planned_step=1.0, sim_pipeline=2.0, sim_step=5.0, sim_optimizer=3.0,
                stages=30, microbatches=2,
                plan_peaks={"gpu0": 2 * 2**30, "gpu1": 2**30}, budgets={"gpu0": 3 * 2**30, "gpu1": 3 * 2**30})
    return gc.RunFigures(**{**base, **kw})


def test_report_compares_the_median_after_the_first_step_and_labels_every_figure():
    fig = _figures(step_times=[100.0, 9.0, 11.0], pipeline_times=[90.0, 3.0, 5.0], optimizer_times=[10.0, 6.0, 6.0],
                   losses=[11.0, 10.9, 10.8],
                   peaks=[gc.PeakRow("cuda:0", ("gpu0", "gpu1"), 3 * 2**30, 6 * 2**30, 2 * 2**30, 6 * 2**30)],
                   moved={"weight h2d": 300, "gradient d2h": 100}, ir={"weight h2d": 200, "gradient d2h": 100},
                   plan_ir={"weight h2d": 200, "gradient d2h": 100})
    text = gc.format_run(fig)
    lines = text.splitlines()

    def line(*words):
        found = [ln for ln in lines if all(w in ln for w in words)]
        assert found, (words, text)
        return found[0]

    assert "ratio  2.00x" in line("step (fwd+bwd+AdamW)", "[measured]", "[simulated]")  # median(9, 11) / 5
    assert "ratio  2.00x" in line("fwd+bwd", "[measured]", "[simulated]")  # median(3, 5) / 2
    assert "ratio  4.00x" in line("fwd+bwd", "[measured]", "[planned]")
    assert "ratio  2.00x" in line("AdamW", "[measured]", "[simulated]")
    peak = line("cuda:0 (gpu0, gpu1)")
    assert "[measured] 6.00 GiB" in peak and "[planned] 3.00 GiB  ratio 2.00x" in peak and "[books] 2.00 GiB" in peak
    assert "ratio 1.50x" in line("weight h2d", "[measured]", "[IR]")
    assert "ratio 1.00x" in line("gradient d2h", "[measured]", "[IR]")
    assert "last 2 of 3 steps" in text


def test_a_dry_run_plans_and_simulates_without_measuring(capsys):
    assert gc.main(["--dry-run", *SMALL, "--memory", "16MiB"]) == 0
    text = capsys.readouterr().out
    assert "no GPU used" in text and "[assumed]" in text
    assert "[simulated]" in text and "[planned]" in text and "[measured]" not in text
    assert "gpu0, gpu1 share cuda:0" in text


def test_each_dry_run_figure_says_what_it_counts():
    text = gc.format_run(_figures())  # nothing measured: a dry run's figures
    rows = [ln for ln in text.splitlines() if "[simulated]" in ln or ln.strip().startswith("fwd+bwd")]
    step = next(ln for ln in rows if "step (fwd+bwd+AdamW)" in ln)
    sim = next(ln for ln in rows if "fwd+bwd" in ln and "[simulated]" in ln and "AdamW" not in ln)
    planned = next(ln for ln in rows if "[planned]" in ln)
    assert "hand-over" in step and "CPU AdamW" in step and "host copies" in step
    assert "gradient offload" in sim and "no optimizer" in sim
    assert "partitioner's model" in planned and "fused host passes that end after the GPUs" in planned


def test_plan_only_gives_the_simulated_and_planned_figures_for_the_budget():
    args = _args(*SMALL)
    topo = Topology.from_dict(gc.budget_topology_dict(2, 16 * 2**20, [gc.LinkFigures(50e9, 50e9)], spec="h200"))
    fig = gc.plan_only(args, topo, bandwidth_source="assumed")
    assert fig.stages > 2 and fig.microbatches == 2  # weights over the budget: streamed through
    assert 2 * fig.params > 2 * 16 * 2**20  # bf16 weights over both budgets together
    assert fig.sim_step > fig.sim_pipeline > 0 and fig.planned_step > 0
    assert all(0 < b <= 16 * 2**20 for b in fig.plan_peaks.values())
    assert fig.plan_ir["weight h2d"] > 2 * fig.params and fig.plan_ir["gradient d2h"] >= 2 * fig.params
    assert not fig.step_times


def test_the_gpu_phase_on_virtual_gpus_moves_exactly_the_ir_and_stays_in_budget():
    args = _args("--device", "virtual", "--params", "3e5", "--hidden", "128", "--blocks", "2", "--vocab", "256",
                 "--seq", "32", "--batch", "4", "--memory", "4MiB", "--steps", "2", "--adamw", "foreach",
                 "--time-limit", "2")
    topo = Topology.from_dict(gc.budget_topology_dict(2, 4 * 2**20, [gc.LinkFigures(50e9, 50e9)] * 2, spec="cpu"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fig = gc.train_gpt(args, topo, device="virtual", bandwidth_source="assumed")
    finally:
        torch.set_num_threads(before)
    assert len(fig.step_times) == len(fig.losses) == 2 and fig.losses[1] < fig.losses[0]
    assert fig.moved["weight h2d"] > 0 and fig.moved == fig.ir and fig.moved["weight h2d"] == fig.plan_ir["weight h2d"]
    # the plan books the gradients as streamed (bf16); the runtime widened the untied ones to fp32 here
    assert fig.plan_ir["gradient d2h"] < fig.moved["gradient d2h"] <= 2 * fig.plan_ir["gradient d2h"]
    assert [p.names for p in fig.peaks] == [("gpu0",), ("gpu1",)]
    for p in fig.peaks:
        assert p.allocator_bytes is None and 0 < p.books_bytes <= p.plan_bytes <= p.budget_bytes
    text = gc.format_run(fig)
    assert "ratio 1.00x" in next(ln for ln in text.splitlines() if "weight h2d" in ln and "[IR]" in ln)


# ------------------------------------------------------------ the limits, the peer, the host
gl = sys.modules["gpu_limits"]  # imported by gpu_check from benchmarks/
cpu_opt = sys.modules["cpu_optimizer"]


def test_the_link_bound_is_the_slower_direction_of_the_bytes_at_their_bandwidth():
    b = gl.link_bound(10 * 2**30, 4 * 2**30, 40e9, 50e9)
    assert b.h2d_time == pytest.approx(10 * 2**30 / 40e9) and b.d2h_time == pytest.approx(4 * 2**30 / 50e9)
    assert b.time == b.h2d_time
    assert gl.link_bound(1, 10, 1e9, 1e9).time == pytest.approx(10e-9)  # downloads can be the slower way
    for bad in [(1, 1, 0, 1e9), (1, 1, 1e9, -1), (-1, 1, 1e9, 1e9)]:
        with pytest.raises(ValueError):
            gl.link_bound(*bad)
    # per CUDA device over its own link: the slowest device's bound
    links = [gc.LinkFigures(50e9, 50e9), gc.LinkFigures(10e9, 50e9)]
    moved = {0: {"weight h2d": 100e9, "gradient d2h": 0}, 1: {"weight h2d": 30e9, "gradient d2h": 10e9}}
    assert gc.device_link_bound(moved, links).time == pytest.approx(3.0)  # device 1: 30 GB at 10 GB/s
    assert gc.device_link_bound({}, links) is None


def test_the_resident_model_fits_when_its_bf16_weights_and_gradients_do():
    assert gl.resident_fits(10**9, 4 * 10**9) == ""
    assert "does not fit" in gl.resident_fits(10**9, 4 * 10**9 - 1)
    assert gl.ResidentFigures(times=[9.0, 2.0, 4.0]).time == 3.0  # the first step left out
    assert gl.ResidentFigures(skipped="does not fit").time is None


def _peer():
    return gl.PeerFigures(optimizer="AdamW(fused)", pipeline_times=[11.0, 0.6, 0.8], optimizer_times=[2.0, 0.7, 0.9],
                          losses=[11.0, 10.0, 9.0], peak_bytes=12 * 2**30, notes=["sharded in 3.0 s"])


def _line(text, *words):
    found = [ln for ln in text.splitlines() if all(w in ln for w in words)]
    assert found, (words, text)
    return found[0]


def test_each_measured_time_is_a_ratio_to_the_compute_limit_and_the_link_bound_and_to_the_peer():
    lim = gl.Limits(resident=gl.ResidentFigures(times=[5.0, 0.2, 0.2], peak_bytes=20 * 2**30),
                    link=gl.link_bound(40 * 10**9, 8 * 10**9, 100e9, 80e9), peer=_peer())
    text = gl.format_limits(lim, fwd_bwd=2.0, step=3.2, optimizer=1.2, gpu_peak=3 * 2**30, budget=6 * 2**30,
                            steps=3, simulated=0.5)
    assert "200.0 ms" in _line(text, "compute: resident") and "peak 20.00 GiB" in _line(text, "compute: resident")
    assert "bound [measured] 400.0 ms" in _line(text, "link:")  # 40 GB at 100 GB/s; 8 GB at 80 GB/s is 100 ms
    row = _line(text, "Mobius fwd+bwd [measured]")
    assert "10.00x the compute limit" in row and "5.00x the link bound" in row
    assert "16.00x the compute limit" in _line(text, "Mobius step [measured]")
    assert "1.25x the link bound" in _line(text, "Mobius fwd+bwd [simulated]")
    assert "3.50x the compute limit" in _line(text, "FSDP2 fwd+bwd [measured]")  # median(0.6, 0.8) / 0.2
    assert "the peer, PyTorch FSDP2" in text and "AdamW(fused)" in text
    assert "budget 6.00 GiB" in _line(text, "Mobius ", "GiB")
    ratios = _line(text, "Mobius / FSDP2").split()
    assert ratios[-4:] == ["2.86x", "1.50x", "2.13x", "0.25x"]  # 2/0.7, 1.2/0.8, 3.2/1.5, 3/12 GiB
    assert "sharded in 3.0 s" in text


def test_without_a_measurement_the_limits_say_why_and_print_no_ratio():
    lim = gl.Limits(resident=gl.ResidentFigures(skipped="does not fit: 12 GiB"), why={"peer": "--skip-peer"})
    text = gl.format_limits(lim, fwd_bwd=1.0, step=2.0, optimizer=1.0, gpu_peak=None, budget=None, steps=3)
    assert "n/a (does not fit: 12 GiB)" in text and "link: n/a" in text and "not run (--skip-peer)" in text
    assert "n/a the compute limit" in _line(text, "Mobius fwd+bwd") and "FSDP2 fwd+bwd" not in text


def test_the_peer_needs_cuda_and_says_so_instead_of_raising():
    if torch.cuda.is_available():
        pytest.skip("checks the guard on a machine without CUDA")
    fig, err = gl.run_peer_reported(torch.nn.Linear(2, 2), [], (torch.zeros(1, 2),), steps=1, kind="fused", lr=1e-3)
    assert fig is None and "needs CUDA" in err


def test_the_host_figures_go_into_the_topology_json_and_read_back(tmp_path):
    host = gl.host_figures(params=10**9, optimizer_times=[9.0, 0.5, 0.7], implementation="fused",
                           host_copy_bps=4.5e10, cores=16)
    assert host.optimizer_bytes_per_s == pytest.approx(28e9 / 0.6) and host.optimizer == "adamw"
    machine = gc.machine_topology_dict([("NVIDIA H200", 150 * 10**9)], [gc.LinkFigures(35e9, 51e9, 0.92)], spec="h200")
    path = tmp_path / "topology.json"
    topo = gc.write_topology(path, machine, host)
    back = Topology.from_json(path)
    assert back == topo and back.host == host and back.host.cores == 16
    assert back.bandwidth("host", "gpu0") == pytest.approx(35e9, abs=1)
    # cpu_optimizer.py --topology-out writes the same section into an existing file, the rest kept
    other = gl.HostFigures(optimizer="adamw", implementation="foreach", optimizer_bytes_per_s=1e10, cores=2)
    assert cpu_opt.write_host(path, other) == topo.with_host(other) == Topology.from_json(path)
    with pytest.raises(mobius_fx.MobiusError, match="does not exist"):
        cpu_opt.write_host(tmp_path / "none.json", other)


def test_cpu_optimizer_writes_what_it_measured_into_the_topology(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(Topology.from_dict(gc.budget_topology_dict(1, 2**30, [gc.LinkFigures(1e9, 1e9)], spec="h200"))
                    .to_json())
    threads = torch.get_num_threads()
    try:
        cpu_opt.main(["--params", "2e5", "--hidden", "64", "--steps", "1", "--threads", "1", "--topology-out",
                      str(path)])
    finally:
        torch.set_num_threads(threads)
    host = Topology.from_json(path).host
    assert host.optimizer == "adamw" and host.implementation in ("fused", "foreach", "for-loop", "mobius-host-pass")
    assert host.optimizer_bytes_per_s > 0 and host.host_copy_bytes_per_s > 0 and host.cores >= 1
    with pytest.raises(SystemExit, match="does not exist"):
        cpu_opt.main(["--params", "2e5", "--hidden", "64", "--topology-out", str(tmp_path / "missing.json")])


@pytest.mark.parametrize("skip_peer", [False, True])
def test_a_dry_run_bounds_the_plan_by_its_link_and_says_why_nothing_else_ran(capsys, skip_peer):
    args = ["--dry-run", *SMALL, "--memory", "16MiB", "--assume-gbps", "20"] + (["--skip-peer"] if skip_peer else [])
    assert gc.main(args) == 0
    text = capsys.readouterr().out
    link = _line(text, "link: weights h2d")
    assert "20.0 GB/s" in link and "[planned, 20 GB/s assumed]" in link
    assert "n/a (a dry run measures nothing)" in text
    assert "not run (--skip-peer)" in text if skip_peer else "not run (a dry run runs nothing)" in text
    assert "x the link bound" in _line(text, "Mobius fwd+bwd [simulated]") and "[measured]" not in text


def test_a_virtual_run_writes_the_host_section_and_the_limits(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rc = gc.main(["--device", "virtual", "--out", str(tmp_path), "--params", "3e5", "--hidden", "128", "--blocks",
                      "2", "--vocab", "256", "--seq", "32", "--batch", "4", "--memory", "4MiB", "--steps", "2",
                      "--adamw", "foreach", "--time-limit", "2", "--host-copy-params", "1e5"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    text = capsys.readouterr().out
    host = Topology.from_json(tmp_path / "topology.json").host
    # under the default sync overlap opt.step() times only a tail: the host section is the fused pass, timed itself
    assert host.implementation == "mobius-host-pass" and host.optimizer_bytes_per_s > 0 and host.host_copy_bytes_per_s > 0
    assert "step / max = " in _line(text, "roundpipe", "host pass")
    assert "x the link bound" in _line(text, "Mobius fwd+bwd [measured]")
    assert "FSDP2 with CPU offload needs a CUDA device" in text
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["host"] == host.to_dict() and report["limits"]["mobius"]["link"]["h2d_bytes"] > 0
    # both default schedules trained by train_step under the sync overlap, each against its own bytes
    assert set(report["gpt"]) == {"mobius", "roundpipe"}
    assert "x the link bound" in _line(text, "roundpipe sched. fwd+bwd [measured]")
    for name, fig in report["gpt"].items():
        assert fig["schedule"] == name and fig["loop"] == "train_step" and fig["overlap"] == "sync"
        assert len(fig["losses"]) == 2 and fig["moved"]["weight h2d"] == fig["ir"]["weight h2d"] > 0
    assert report["limits"]["roundpipe"]["link"]["h2d_bytes"] > 0


def _tiny_gpt():
    cfg = gc.gpt_config(3e5, hidden=64, blocks=2, vocab=128, seq=16)
    return gc.build_model(cfg, batch=2, device="cpu")


def test_the_peer_loop_shards_steps_and_times_on_the_cpu(one_thread):
    """The FSDP2 peer's loop as a structure check on the CPU (FSDP2 without offload: no GPU to
    offload from): every block and the root sharded, each step timed, the loss going down."""
    model, inputs = _tiny_gpt()
    fig = gl.run_peer(model, list(model.gpt.h), inputs, steps=3, kind="foreach", lr=1e-2, device="cpu")
    assert len(fig.pipeline_times) == len(fig.optimizer_times) == len(fig.losses) == 3
    assert fig.losses[-1] < fig.losses[0] and fig.optimizer == "AdamW(foreach)" and fig.peak_bytes is None
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())  # every block and the root sharded
    assert fig.step == pytest.approx(statistics.median([a + b for a, b in zip(fig.pipeline_times[1:],
                                                                               fig.optimizer_times[1:])]))
    import torch.distributed as dist

    assert not dist.is_initialized()  # its group is gone: the next run (or test) starts clean


def test_the_peer_falls_back_to_the_next_adamw_when_torch_refuses_one(one_thread, monkeypatch):
    real = gl.adamw

    def picky(params, kind, lr):
        if kind == "fused":
            raise RuntimeError("fused AdamW does not take DTensor parameters here")
        return real(params, kind, lr)

    monkeypatch.setattr(gl, "adamw", picky)
    model, inputs = _tiny_gpt()
    fig = gl.run_peer(model, list(model.gpt.h), inputs, steps=1, kind="fused", lr=1e-2, device="cpu")
    assert fig.optimizer == "AdamW(foreach)" and any("AdamW(fused) refused" in n for n in fig.notes)


def test_the_resident_loop_builds_in_bf16_and_times_every_step_on_the_cpu(one_thread):
    """measure_resident's loop as a structure check on the CPU: the model is made in bf16 where
    it runs (no fp32 copy first: 6 bytes a parameter instead of 2 would not fit beside the
    pipeline's pools), each step timed, the default dtype restored."""
    cfg = gc.gpt_config(3e5, hidden=64, blocks=2, vocab=128, seq=16)
    _, inputs = gc.build_model(cfg, batch=2, device="meta")
    made = []

    def build():
        made.append(gc.GPTWithLoss(cfg))
        return made[-1]

    inputs = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in inputs)
    fig = gl.measure_resident(build, inputs, params=10**5, steps=3, device="cpu")
    assert len(fig.times) == 3 and fig.time == statistics.median(fig.times[1:]) and not fig.skipped
    assert {p.dtype for p in made[0].parameters()} == {torch.bfloat16} and fig.peak_bytes is None
    assert torch.get_default_dtype() == torch.float32


def test_the_limits_phase_hands_the_trained_model_to_the_peer_and_reports_both(one_thread, monkeypatch, capsys):
    """The CUDA phase's glue on the CPU: the GPT phase hands its model back (gradients freed),
    the resident run and the peer (their CPU structure checks standing in for CUDA) take the
    same steps, and the report holds the limits and every ratio."""
    args = _args("--device", "virtual", "--params", "3e5", "--hidden", "128", "--blocks", "2", "--vocab", "256",
                 "--seq", "32", "--batch", "4", "--memory", "4MiB", "--steps", "2", "--adamw", "foreach",
                 "--time-limit", "2")
    links = [gc.LinkFigures(50e9, 50e9)] * 2
    topo = Topology.from_dict(gc.budget_topology_dict(2, 4 * 2**20, links, spec="cpu"))
    kept = {}
    fig = gc.train_gpt(args, topo, device="virtual", bandwidth_source="assumed", hand_back=kept)
    assert all(p.grad is None for p in kept["model"].parameters()) and len(kept["inputs"]) == 2
    resident = gl.measure_resident
    peer = gl.run_peer_reported
    monkeypatch.setattr(gl, "measure_resident", lambda *a, **k: resident(*a, **k, device="cpu"))
    monkeypatch.setattr(gl, "run_peer_reported", lambda *a, **k: peer(*a, **k, device="cpu"))
    report = {}
    assert gc.limits_phase(args, [fig], links, kept, report) is False
    lim = report["limits"]["mobius"]
    assert len(lim.resident.times) == len(lim.peer.pipeline_times) == args.steps == 2
    slowest = max(fig.moved_by_device.values(),  # equal links: the most bytes either way
                  key=lambda m: gl.link_bound(m["weight h2d"], m["gradient d2h"], 50e9, 50e9).time)
    assert (lim.link.h2d_bytes, lim.link.d2h_bytes) == (slowest["weight h2d"], slowest["gradient d2h"])
    assert lim.peer.optimizer == "AdamW(foreach)"
    assert sum(m["weight h2d"] for m in fig.moved_by_device.values()) == fig.moved["weight h2d"]
    assert "model" not in kept and set(report["phase seconds"]) == {"resident", "peer"}
    text = capsys.readouterr().out
    assert "x the compute limit" in _line(text, "FSDP2 step [measured]") and "Mobius / FSDP2" in text

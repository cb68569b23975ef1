"""Quiet, sane defaults (issue 40): compile's log shows the stage table and the transfer summary
(the full transfer table at DEBUG), and a long pass says it is alive in a log file or pipe."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import mobius_fx
from mobius_fx import Topology
from mobius_fx.compiler import heartbeat
from mobius_fx.zoo import ResidualMLP


@pytest.fixture(scope="module")
def compiled_logs():
    """compile's log of one small model at INFO and at DEBUG (torch.fx traces it: fast)."""
    out = {}
    for level in (logging.INFO, logging.DEBUG):
        torch.manual_seed(0)
        model = ResidualMLP(d_in=8, width=16, depth=3, d_out=4)
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: records.append(r.getMessage())
        log = logging.getLogger("mobius_fx")
        old = log.level
        log.addHandler(handler)
        log.setLevel(level)
        try:
            pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(torch.randn(4, 8),),
                                     microbatches=2, verbose=False)
        finally:
            log.removeHandler(handler)
            log.setLevel(old)
        out[level] = ("\n".join(records), pipe.plan)
    return out


def test_compile_logs_the_stage_table_and_the_transfer_summary(compiled_logs):
    text, plan = compiled_logs[logging.INFO]
    assert plan.stage_table() in text and plan.transfer_summary() in text
    assert plan.transfer_table() not in text  # 80 lines for the tiny example, ~650 for 8B: on request only


def test_debug_logs_the_full_transfer_table(compiled_logs):
    text, plan = compiled_logs[logging.DEBUG]
    assert plan.transfer_table() in text and plan.stage_table() in text
    assert plan.transfer_table() in str(plan)  # print(pipe.plan): both full tables, always


def test_a_long_pass_logs_that_it_is_still_running(caplog):
    beat = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "still running" in record.getMessage():
                beat.set()

    seen = Seen()
    log = logging.getLogger("mobius_fx")
    log.addHandler(seen)
    try:
        with caplog.at_level(logging.INFO, logger="mobius_fx"):
            with heartbeat("pass trace", every=0.01):
                assert beat.wait(60)  # the block runs until the heartbeat has spoken (no fixed sleep)
            n = sum("still running" in m for m in caplog.messages)
            with heartbeat("pass trace", every=0.01):
                pass
        assert n >= 1 and caplog.messages[0].startswith("pass trace: still running (")
        beat.clear()
        with heartbeat("pass quiet", every=0.01):  # the logger does not log INFO (no caplog level): nothing
            assert not beat.wait(0.05)
    finally:
        log.removeHandler(seen)

import os

import pytest
import torch

from hypothesis import HealthCheck, settings

# CI runs derandomized with bounded examples so results are stable run to run.
settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Every test traces and annotates anew: a graph cached by an earlier run (or test) would skip
# the tracing a test means to exercise. The cache's own tests turn it on (tests/unit/test_trace_cache.py).
os.environ.setdefault("MOBIUS_FX_TRACE_CACHE", "0")
# The host thread plan sizes the pipeline thread's intra-op team on the cores other processes leave
# free (mobius_fx/runtime/host_threads.py, `steer`): on a shared machine that count, and with it the
# last bits of reductions, would follow the load from step to step, and tests compare bits. So the
# suite (and the subprocesses it starts) keeps torch's counts as they are;
# tests/unit/test_host_threads.py turns steering on for itself.
os.environ.setdefault("MOBIUS_HOST_THREADS", "steer=0")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids stalls when other work shares the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trace_cache(tmp_path_factory):
    """Opt-in for a module whose subject is not tracing (`pytestmark = pytest.mark.usefixtures("trace_cache")`):
    the trace cache on, in a folder of the module's own (``MOBIUS_FX_CACHE``; a compile given `cache_dir=`
    uses that folder's), so a model traced once by the module is read back by its later compiles of the same
    model, code and input shapes (the twin pipelines of a lockstep comparison, the same CLI model planned
    again). A folder per module: no test's outcome depends on which modules ran before it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MOBIUS_FX_TRACE_CACHE", "1")
    mp.setenv("MOBIUS_FX_CACHE", str(tmp_path_factory.mktemp("trace_cache")))
    yield
    mp.undo()

import os

# One torch thread per process in tests: the CI machine has 2 cores and Ray replicas run beside.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import faulthandler  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

# After the last test, the process has this long to exit.
EXIT_GRACE_S = 180


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A non-daemon thread a test left running keeps this process from ever exiting: CI then waits
    out its whole limit and lands nothing (it happened: a /healthz poller outlived a failed test).
    If the process has not exited ``EXIT_GRACE_S`` after the run, every thread's stack goes to
    stderr and it exits with status 1."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.__stderr__)


def pytest_collection_finish(session):
    """What collecting the suite imported (~360k objects: torch, NeMo, transformers) lives to the
    end of the run, so it is moved out of the garbage collector's sight (``gc.freeze``). A full
    collection scanned all of it: 0.18 s each on a quiet 2-core VM, more under load, stalling the
    end-to-end tests' clients in the middle of the gaps between reply chunks they measure, where a
    client's own pause reads as the server's dead air."""
    import gc

    gc.freeze()

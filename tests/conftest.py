import os

# One torch thread per process in tests: the CI machine has 2 cores and Ray replicas run beside.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def server():
    """The real app (`serve run serve_config.yaml`), started once for every end-to-end test."""
    from tests.serve_process import ServeProcess

    proc = ServeProcess()
    proc.start()
    yield proc
    proc.stop()

import os

# One torch thread per process in tests: the CI machine has 2 cores and Ray replicas run beside.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import os

# Triton kernels run on CPU only in the interpreter, and the flag must be set before any
# `@triton.jit` decorator runs, i.e. before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
# fresh examples on every run (`HYPOTHESIS_PROFILE=explore pytest --hypothesis-seed=N ...`): to search further
settings.register_profile("explore", deadline=None, max_examples=25, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tiny models gain nothing from intra-op threads, and OpenMP barriers stall badly on a busy machine.
torch.set_num_threads(1)

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# `auto` precision (fsdp.mixed_precision, rollout.backend_options.dtype) means fp32 in the suite:
# its exactness checks compare with fp32 references, and a measured choice would differ between
# machines; the bf16 tests ask for bf16 explicitly.
os.environ.setdefault("HYBRIDRL_AUTO_PRECISION", "fp32")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests draw the same examples on every run (a CI failure reproduces locally; set
# HYPOTHESIS_PROFILE=explore to search afresh), with no per-example deadline on a shared 2-core
# machine.
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def torch_threads():
    """``torch.set_num_threads`` for a test that runs at a thread count of its own (the job tests
    run at 1 and 2); the count is put back afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)

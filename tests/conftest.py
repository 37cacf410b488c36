import os

import pytest
import torch

# Two cores on CI: keep intra-op threads predictable and tests reproducible.
torch.set_num_threads(int(os.environ.get("LAPHEADS_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

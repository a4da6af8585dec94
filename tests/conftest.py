import sys
from pathlib import Path

import pytest
import torch

# Test helpers (tiny models, the local S3 server) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_thread():
    """Training tests run torch on one thread: two-process tests and a busy 2-vCPU machine
    otherwise oversubscribe the cores many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

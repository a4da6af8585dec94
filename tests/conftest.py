import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

# Test helpers (tiny models, the local S3 server) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def trainers(monkeypatch) -> list:
    """Every Trainer whose fit() runs during the test, in order (to inspect the model it trained)."""
    from latentforge.train.trainer import Trainer

    seen: list[Trainer] = []
    fit = Trainer.fit

    def keep(self, resume_from=None):
        seen.append(self)
        return fit(self, resume_from)

    monkeypatch.setattr(Trainer, "fit", keep)
    return seen


@pytest.fixture(scope="module")
def one_thread():
    """Training tests run torch on one thread: two-process tests and a busy 2-vCPU machine
    otherwise oversubscribe the cores many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread_offline():
    """One intra-op thread: the models are tiny, and with other processes on the 2 vCPUs two
    threads made one generate call 100x slower (measured 20 s against 0.2 s). Hub access off:
    the export must load from its directory alone."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield
    torch.set_num_threads(num_threads)

"""Every test runs offline: no hub downloads, wandb writes local runs only."""

import os
from collections.abc import Iterator

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Tiny models run fastest single-threaded (thread wake-ups dominate on a busy CPU); modules opt
    in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""Shared pytest set-up: deterministic, single-threaded torch (2-core machines), and repo-root imports."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True, scope="session")
def _torch_setup():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield

"""What can be checked here of the TensorRT plugins and the GPU check (no TensorRT, no CUDA on CI machines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugins import trt_plugins

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(trt_plugins.tensorrt_available(), reason="real TensorRT present")
def test_register_plugins_without_tensorrt_raises_clearly() -> None:
    with pytest.raises(RuntimeError, match="TensorRT is not installed.*TensorRT >= 10"):
        trt_plugins.register_plugins()


@pytest.mark.skipif(not trt_plugins.tensorrt_available(), reason="needs TensorRT")
def test_register_plugins_with_tensorrt() -> None:
    import tensorrt as trt

    assert trt_plugins.register_plugins() == ["KvWrite", "PagedAttention"]
    for name in trt_plugins.PLUGIN_NAMES:
        assert trt.get_plugin_registry().get_creator(name, "1", "mtp") is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the real check runs via `make gpu-check`")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    done = subprocess.run([sys.executable, "-m", "plugins.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"skipped": "no CUDA device: skipping GPU check"}

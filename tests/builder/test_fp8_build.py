"""`mtp-build` on an FP8 checkpoint as released (float8_e4m3fn + 128x128 block scales): the engine holds the
weights dequantized at build time, runs like a float engine, and a damaged FP8 checkpoint is refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from builder import cli
from models.checkpoint import load_model
from models.engine_format import load_engine_config
from models.testing import quantize_checkpoint_fp8
from runtime.executors.base import MainInput
from runtime.executors.ort_executor import OrtExecutor
from runtime.executors.torch_executor import TorchExecutor
from tests.builder.conftest import LIMITS
from tests.builder.test_bad_checkpoint import _argv, refused


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    quantize_checkpoint_fp8(checkpoint, path)
    return path


@pytest.fixture(scope="module")
def fp8_engine(fp8_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8eng") / "engine"
    assert cli.main(_argv(fp8_checkpoint, out, "--world-size", "2", "--ep-size", "2")) == 0
    return out


def test_fp8_engine_holds_the_dequantized_experts(fp8_engine, fp8_checkpoint, checkpoint):
    assert load_file(str(fp8_checkpoint / "model.safetensors"))[
        "model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn  # fmt: skip
    for rank in (0, 1):
        want = load_model(fp8_checkpoint, ep_rank=rank, ep_size=2)[0].layers[1].mlp.w_down.detach().numpy()
        unquantized = load_model(checkpoint, ep_rank=rank, ep_size=2)[0].layers[1].mlp.w_down.detach().numpy()
        assert not np.array_equal(want, unquantized)  # FP8 rounding shows: the engine is not the float model
        m = onnx.load(str(fp8_engine / f"rank{rank}" / "main.onnx"))
        inits = [numpy_helper.to_array(i) for i in m.graph.initializer]
        assert any(v.shape == want.shape and (v == want).all() for v in inits), f"rank {rank} experts"
    assert cli.main(["--check", str(fp8_engine)]) == 0


def test_fp8_engine_runs_like_its_torch_model(fp8_checkpoint, tmp_path):
    out = tmp_path / "engine"
    assert cli.main(_argv(fp8_checkpoint, out, "--num-draft-tokens", "0")) == 0
    ort_ex = OrtExecutor(out, num_blocks=20)
    torch_ex = TorchExecutor(load_model(fp8_checkpoint)[0], num_blocks=20, block_size=LIMITS["kv_block_size"])
    table = np.full((1, load_engine_config(out).kv.table_width), -1, np.int32)
    table[0, :2] = [1, 2]
    step = MainInput(input_ids=np.arange(3, 10), positions=np.arange(7), q_counts=np.array([7], np.int32),
                     kv_lens=np.array([7], np.int32), block_tables=table, logit_rows=np.array([6]))  # fmt: skip
    a, b = ort_ex.run_main(step), torch_ex.run_main(step)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-4, atol=1e-4)


def test_fp8_checkpoint_without_a_scale_is_refused(fp8_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_checkpoint, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors.pop(name + "_scale_inv")
    save_file(tensors, str(bad / "model.safetensors"))
    refused(capsys, bad, tmp_path / "engine", rf"tensor {name} in model\.safetensors is float8_e4m3fn but its block "
            r"scale .*_scale_inv is missing; re-download")  # fmt: skip

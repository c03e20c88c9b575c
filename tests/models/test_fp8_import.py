"""FP8 checkpoints as released (float8_e4m3fn + 128x128 block `weight_scale_inv`) import dequantized.

A tiny float checkpoint (models/testing.py) is quantized the way the releases were (amax per block / 448), imported,
and compared to the float original within the FP8 rounding bound and exactly to a dequantize-in-the-test reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import CheckpointError, load_model
from models.checkpoint_files import index_checkpoint, read_tensor
from models.fp8 import dequantize, quantize
from models.testing import is_fp8_quantized, make_checkpoint, quantize_checkpoint_fp8, tiny_config

# hidden 160 and moe_intermediate 136: weights span full and partial 128-blocks in both dims
CFG = tiny_config(hidden_size=160, intermediate_size=272, moe_intermediate_size=136, head_dim=40)
ST = "model.safetensors"
Q = "model.layers.0.self_attn.q_proj.weight"


def reference_dequant(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The definition, written the plain way: every element times its 128x128 block's scale."""
    rows, cols = q.shape
    full = scale_inv.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:rows, :cols]
    return q.float() * full


def fp8_bound(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Per-element rounding bound of e4m3 (3 mantissa bits): half a step, |x| / 16 for normals and 2^-10 for
    subnormals, in units of the block's scale."""
    rows, cols = w.shape
    s = scale_inv.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:rows, :cols]
    return torch.maximum(w.abs() / 16, s * 2.0**-10) * (1 + 1e-6)


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (7, 5), (129, 1)])
def test_quantize_dequantize_within_the_fp8_bound(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, shape[1])
    q, s = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    got = dequantize(q, s)
    assert torch.equal(got, reference_dequant(q, s))
    assert ((got - w).abs() <= fp8_bound(w, s)).all()
    assert not torch.equal(got, w)  # it did round (the test could fail)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(float original, its FP8 release, a float checkpoint of the FP8 values dequantized in the test)."""
    root = tmp_path_factory.mktemp("fp8")
    make_checkpoint(root / "float", CFG, seed=5)
    quantize_checkpoint_fp8(root / "float", root / "fp8")
    raw = load_file(str(root / "fp8" / ST))
    deq = {n: reference_dequant(t, raw[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
           for n, t in raw.items() if not n.endswith("_scale_inv")}  # fmt: skip
    (root / "deq").mkdir()
    save_file(deq, str(root / "deq" / ST))
    (root / "deq" / "config.json").write_text((root / "float" / "config.json").read_text())
    return root / "float", root / "fp8", root / "deq"


def test_fp8_checkpoint_imports_dequantized(ckpts):
    float_dir, fp8_dir, deq_dir = ckpts
    raw = load_file(str(fp8_dir / ST))
    assert raw[Q].dtype == torch.float8_e4m3fn and raw[Q + "_scale_inv"].shape == (2, 2)  # q_proj [160, 160]
    fp8, _ = load_model(fp8_dir)
    exact, _ = load_model(deq_dir)
    ref, _ = load_model(float_dir)
    got, want, orig = fp8.state_dict(), exact.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name
    w, s = orig["layers.0.self_attn.q_proj.weight"], raw[Q + "_scale_inv"]
    err = (got["layers.0.self_attn.q_proj.weight"] - w).abs()
    assert (err <= fp8_bound(w, s)).all() and err.max() > 0
    gate = orig["layers.1.mlp.w_gate_up"][2, :136]  # expert 2's gate_proj
    s = raw["model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"]
    assert ((got["layers.1.mlp.w_gate_up"][2, :136] - gate).abs() <= fp8_bound(gate, s)).all()
    assert torch.equal(got["embed_tokens.weight"], orig["embed_tokens.weight"])  # not quantized: untouched
    for ep_rank in range(2):  # a rank's share of the FP8 experts is the same dequantized slice
        part, _ = load_model(fp8_dir, ep_rank=ep_rank, ep_size=2)
        for name in ("layers.1.mlp.w_gate_up", "mtp.0.block.mlp.w_down"):
            assert torch.equal(part.state_dict()[name], got[name][2 * ep_rank : 2 * ep_rank + 2]), name


def test_fp8_engine_dtype_conversion(ckpts):
    _, fp8_dir, deq_dir = ckpts
    got, _ = load_model(fp8_dir, torch.bfloat16)
    want, _ = load_model(deq_dir, torch.bfloat16)
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("window", [(slice(0, 160), slice(0, 160)), (slice(5, 150), slice(100, 131)),
                                    (slice(128, 160), slice(127, 129)), (slice(40, 40), slice(0, 160))])  # fmt: skip
def test_fp8_windows_read_only_their_blocks(ckpts, window):
    """A row/column window (what tensor-parallel slicing will read) dequantizes with the blocks it touches."""
    _, fp8_dir, _ = ckpts
    idx = index_checkpoint(fp8_dir)
    raw = load_file(str(fp8_dir / ST))
    bounds = tuple(s.indices(160)[:2] for s in window)
    got = read_tensor(idx, Q, bounds, torch.float32)
    assert torch.equal(got, reference_dequant(raw[Q], raw[Q + "_scale_inv"])[window])


def _damage(ckpts, tmp_path, tensors=None, quant=None) -> Path:
    _, fp8_dir, _ = ckpts
    path = tmp_path / "bad"
    path.mkdir()
    raw = load_file(str(fp8_dir / ST))
    if tensors:
        tensors(raw)
    save_file(raw, str(path / ST))
    hf = json.loads((fp8_dir / "config.json").read_text())
    if quant:
        quant(hf)
    (path / "config.json").write_text(json.dumps(hf))
    return path


SCALE = Q + "_scale_inv"
BAD = [
    ("missing-scale", dict(tensors=lambda t: t.pop(SCALE)),
     rf"tensor {Q} in model\.safetensors is float8_e4m3fn but its block scale {SCALE} is missing"),
    ("scale-wrong-shape", dict(tensors=lambda t: t.update({SCALE: torch.ones(1, 2)})),
     rf"tensor {SCALE} has dtype F32 and shape \[1, 2\], but weight {Q} \[160, 160\] with 128x128 blocks needs "
     r"F32 \[2, 2\]"),
    ("scale-wrong-dtype", dict(tensors=lambda t: t.update({SCALE: t[SCALE].bfloat16()})), r"has dtype BF16 .* needs F32"),
    ("stray-scale", dict(tensors=lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)})),
     r"scales model\.norm\.weight, which is float32, not float8_e4m3fn"),
    ("no-quantization-config", dict(quant=lambda h: h.pop("quantization_config")),
     r"tensor \S+ in model\.safetensors is float8_e4m3fn but .*config\.json has no quantization_config"),
    ("quant-method", dict(quant=lambda h: h["quantization_config"].update(quant_method="awq")),
     r"config\.json: quantization_config\.quant_method 'awq' is not supported; supported: quant_method \"fp8\""),
    ("fmt", dict(quant=lambda h: h["quantization_config"].update(fmt="e5m2")),
     r"quantization_config\.fmt 'e5m2' is not supported; supported: .*fmt \"e4m3\""),
    ("block-size", dict(quant=lambda h: h["quantization_config"].update(weight_block_size=[64, 64])),
     r"quantization_config\.weight_block_size \[64, 64\] is not supported; supported: .*\[128, 128\]"),
    ("activation-scheme", dict(quant=lambda h: h["quantization_config"].update(activation_scheme="static")),
     r"quantization_config\.activation_scheme 'static' is not supported .*activation_scheme \"dynamic\""),
    ("scale-fmt", dict(quant=lambda h: h["quantization_config"].update(scale_fmt="ue8m0")),
     r"quantization_config\.scale_fmt 'ue8m0' is not supported"),
    ("fp8-norm", dict(tensors=lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn),
                                                  "model.norm.weight_scale_inv": torch.ones(1)})),  # fmt: skip
     r"tensor model\.norm\.weight is float8_e4m3fn with shape \[160\]: only 2-D weights are block-quantized"),
]


@pytest.mark.parametrize("damage, pattern", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_fp8_checkpoint_is_named_before_any_read(ckpts, tmp_path, damage, pattern):
    path = _damage(ckpts, tmp_path, **damage)
    with pytest.raises(CheckpointError, match=pattern) as e:
        index_checkpoint(path)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(path)


def test_quantized_set_is_the_projections():
    assert is_fp8_quantized(Q, (160, 160)) and is_fp8_quantized("model.layers.2.eh_proj.weight", (8, 16))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert not is_fp8_quantized(name, (96, 160))
    indexer = "model.layers.3.self_attn.indexer."  # DSA (GLM-5-FP8, DeepSeek-V3.2): wq_b and wk FP8, weights_proj not
    assert is_fp8_quantized(indexer + "wq_b.weight", (96, 24)) and is_fp8_quantized(indexer + "wk.weight", (12, 32))
    assert not is_fp8_quantized(indexer + "weights_proj.weight", (8, 32))


def test_fp8_mla_checkpoint_imports_dequantized(tmp_path):
    """DeepSeek-V3 as released: FP8 MLA projections (q_a/q_b, kv_a_proj_with_mqa, kv_b, o) and experts import
    equal to the float checkpoint of the same dequantized values, tensor for tensor (through the rope
    de-interleave; load_model dequantizes first because the 128x128 blocks index the checkpoint's row order,
    which this tiny model, inside one block, cannot tell apart)."""
    from models.testing import MLA_VARIANTS, make_mla_checkpoint

    model_type, overrides = MLA_VARIANTS["dsv3"]
    make_mla_checkpoint(tmp_path / "float", model_type, seed=2, **overrides)
    quantize_checkpoint_fp8(tmp_path / "float", tmp_path / "fp8")
    raw = load_file(str(tmp_path / "fp8" / ST))
    assert raw["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    deq = {n: reference_dequant(t, raw[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
           for n, t in raw.items() if not n.endswith("_scale_inv")}  # fmt: skip
    (tmp_path / "deq").mkdir()
    save_file(deq, str(tmp_path / "deq" / ST))
    (tmp_path / "deq" / "config.json").write_text((tmp_path / "float" / "config.json").read_text())
    got, want = load_model(tmp_path / "fp8")[0].state_dict(), load_model(tmp_path / "deq")[0].state_dict()
    orig = load_model(tmp_path / "float")[0].state_dict()
    for name in got:
        assert torch.equal(got[name], want[name]), name
    name = "layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert 0 < (got[name] - orig[name]).abs().max() < 0.1 * orig[name].abs().max()

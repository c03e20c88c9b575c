"""FP8 checkpoints as DeepSeek-V3 and GLM-4.5-FP8 release them: the config check and the block dequantization.

A quantized weight `W [out, in]` is stored as `float8_e4m3fn` with a companion float32 `W_scale_inv` of shape
`[ceil(out/128), ceil(in/128)]`; the weight is `fp8.float() * scale_inv[i // 128, j // 128]` (the convention of
DeepSeek-V3's `inference/kernel.py` `weight_dequant` and transformers' `finegrained_fp8`; the last row and column
blocks are partial when a dim is not a multiple of 128). config.json says so with `quantization_config:
{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}`.
The build dequantizes to the engine dtype (nothing here runs FP8 arithmetic); pure functions, no file access.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = "F8_E4M3"  # the safetensors dtype code of torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # `model.layers.0.self_attn.q_proj.weight` -> `..._proj.weight_scale_inv`
BLOCK = (128, 128)
SUPPORTED = ('quant_method "fp8" with fmt "e4m3", weight_block_size [128, 128], activation_scheme "dynamic" and '
             'float32 scales (DeepSeek-V3 / GLM-4.5-FP8)')  # fmt: skip


class Fp8Error(ValueError):
    """An FP8 checkpoint this importer cannot dequantize; the message names the field or tensor and the fix."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    block: tuple[int, int] = BLOCK


def parse_quantization_config(hf: dict[str, Any]) -> Fp8Scheme | None:
    """The scheme config.json declares (None: not quantized); anything but the released FP8 scheme is refused."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise Fp8Error(f"quantization_config must be a JSON object, got {q!r}; fix config.json")
    fix = f"supported: {SUPPORTED}; dequantize the checkpoint or use its float release"
    method = q.get("quant_method")
    if method != "fp8":
        raise Fp8Error(f"quantization_config.quant_method {method!r} is not supported; {fix}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise Fp8Error(f"quantization_config.fmt {q['fmt']!r} is not supported; {fix}")
    block = q.get("weight_block_size", list(BLOCK))  # transformers' default when absent
    if not isinstance(block, list | tuple) or list(block) != list(BLOCK):
        raise Fp8Error(f"quantization_config.weight_block_size {block!r} is not supported; {fix}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Fp8Error(f"quantization_config.activation_scheme {scheme!r} is not supported (the engine runs "
                       f"dequantized weights, so static activation scales have no use); {fix}")  # fmt: skip
    if q.get("scale_fmt", "float") != "float":
        raise Fp8Error(f"quantization_config.scale_fmt {q['scale_fmt']!r} is not supported; {fix}")
    return Fp8Scheme(BLOCK)


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    rows, cols = weight_shape
    return (-(-rows // block[0]), -(-cols // block[1]))


def check_pair(name: str, weight_shape: tuple[int, ...], scale_dtype: str, scale_dims: tuple[int, ...],
               block: tuple[int, int] = BLOCK) -> None:  # fmt: skip
    """An FP8 weight and its scale agree (from the header alone, before any data is read)."""
    if len(weight_shape) != 2:
        raise Fp8Error(f"tensor {name} is float8_e4m3fn with shape {list(weight_shape)}: only 2-D weights are "
                       "block-quantized; re-export the checkpoint")  # fmt: skip
    want = scale_shape(weight_shape, block)
    if tuple(scale_dims) != want or scale_dtype != "F32":
        raise Fp8Error(
            f"tensor {name}{SCALE_SUFFIX} has dtype {scale_dtype} and shape {list(scale_dims)}, but weight {name} "
            f"{list(weight_shape)} with {block[0]}x{block[1]} blocks needs F32 {list(want)}; the scale does not "
            "belong to this weight: re-download the checkpoint"
        )


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, row0: int = 0, col0: int = 0,
               block: tuple[int, int] = BLOCK) -> torch.Tensor:  # fmt: skip
    """float32 values of `q`, the [row0:, col0:] window of a block-quantized weight.

    `scale_inv` holds the scale rows/columns of the blocks the window touches, starting with block
    (row0 // block[0], col0 // block[1]). One multiply per element, row block by row block, so the only
    temporary is one row of column scales (never a second weight-sized tensor).
    """
    bm, bn = block
    out = q.to(torch.float32)
    rows, cols = out.shape
    first_r, first_c = row0 // bm, col0 // bn
    # each column's scale index, relative to the window's first column block
    col_block = (torch.arange(col0, col0 + cols) // bn) - first_c
    for b in range(first_r, (row0 + rows - 1) // bm + 1 if rows else first_r):
        lo, hi = max(b * bm, row0) - row0, min((b + 1) * bm, row0 + rows) - row0
        out[lo:hi].mul_(scale_inv[b - first_r].to(torch.float32)[col_block])
    return out


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) by amax per block / 448, as the released checkpoints were made.

    For tests (tiny round trips) and tools; an all-zero block gets scale 1 so it stays exactly zero.
    """
    bm, bn = block
    rows, cols = w.shape
    r, c = scale_shape((rows, cols), block)
    pad = torch.zeros(r * bm, c * bn, dtype=torch.float32)
    pad[:rows, :cols] = w.float()
    blocks = pad.view(r, bm, c, bn)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(r * bm, c * bn)[:rows, :cols].contiguous(), scale_inv.float()

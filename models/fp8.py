"""FP8 checkpoints as DeepSeek-V3 and GLM-4.5-FP8 release them: the config check and the block dequantization.

A quantized weight `W [out, in]` is stored as `float8_e4m3fn` with a companion float32 `W_scale_inv` of shape
`[ceil(out/128), ceil(in/128)]`; the weight is `fp8.float() * scale_inv[i // 128, j // 128]` (the convention of
DeepSeek-V3's `inference/kernel.py` `weight_dequant` and transformers' `finegrained_fp8`; the last row and column
blocks are partial when a dim is not a multiple of 128). config.json says so with `quantization_config:
{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}`.
The build dequantizes to the engine dtype for its graphs; the compiled engine keeps the release's FP8 bytes and
scales instead (`release_window`, the one reader of raw FP8 data; docs/CHECKPOINTS.md "FP8 checkpoints").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

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


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A rank's window of a canonical FP8 weight as released: float8_e4m3fn `weight` and fp32 `scale_inv`. A 2-D
    weight [N, K] has scales [ceil(N/128), ceil(K/128)]; a stack of experts [E, parts * R, C] (parts = 2 for
    w_gate_up: gate rows, then up rows) has [E, parts * ceil(R/128), ceil(C/128)], each part blocked on its own."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    parts: int = 1


def release_window(idx: Any, ct: Any, bounds: tuple[tuple[int, int], ...],
                   rows: torch.Tensor | None = None) -> Fp8Weight | None:  # fmt: skip
    """The [start, stop) `bounds` window of canonical tensor `ct` (models/checkpoint_files.py CanonicalTensor over the
    CheckpointIndex `idx`) as released, or None when it is not FP8 throughout or its window does not keep whole
    scale blocks: a 2-D weight that is one FP8 tensor, whose window starts on a block boundary (`rows`: the row
    permutation the import applies, which must keep every row in its block), or a stack of whole experts whose
    pieces are FP8 tensors of one shape (gate | up, or down)."""
    if idx.fp8 is None or not all(idx.tensors[p.source].scale for p in ct.pieces):
        return None
    (bm, bn), srcs = idx.fp8.block, [idx.tensors[p.source] for p in ct.pieces]
    with contextlib.ExitStack() as stack:
        files: dict[Any, Any] = {}

        def read(file: Any, name: str, window: tuple[slice, ...] = ()) -> torch.Tensor:
            if file not in files:
                files[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            view = files[file].get_slice(name)
            return (view[window] if window else view[:]).contiguous()

        if len(ct.shape) == 2 and len(ct.pieces) == 1 and not ct.pieces[0].stacked:
            (r0, r1), (c0, c1) = bounds
            same = torch.arange(r0, r1)
            rows = same if rows is None else rows[r0:r1]
            if r0 % bm or c0 % bn or not torch.equal(rows // bm, same // bm):
                return None
            q = read(srcs[0].file, ct.pieces[0].source, (slice(r0, r1), slice(c0, c1)))
            s = read(idx.scales[srcs[0].scale].file, srcs[0].scale,
                     (slice(r0 // bm, -(-r1 // bm)), slice(c0 // bn, -(-c1 // bn))))  # fmt: skip
            if not torch.equal(rows, same):
                q = q.view(torch.uint8).index_select(0, rows - r0).view(torch.float8_e4m3fn)
            return Fp8Weight(q, s.float())
        part = srcs[0].shape[0]
        if (len(ct.shape) != 3 or not all(p.stacked for p in ct.pieces) or tuple(bounds[1:]) != ((0, ct.shape[1]),
                (0, ct.shape[2])) or ct.shape[1] % part or any(t.shape != srcs[0].shape for t in srcs)
                or any(p.offset[1] % part or p.offset[2] for p in ct.pieces)):  # fmt: skip
            return None
        (e0, e1), blocks = bounds[0], -(-part // bm)
        q = torch.empty(e1 - e0, *ct.shape[1:], dtype=torch.float8_e4m3fn)
        s = torch.empty(e1 - e0, ct.shape[1] // part * blocks, -(-ct.shape[2] // bn))
        for p, src in zip(ct.pieces, srcs, strict=True):
            if e0 <= p.offset[0] < e1:
                e, k = p.offset[0] - e0, p.offset[1] // part
                q[e, p.offset[1] : p.offset[1] + part] = read(src.file, p.source)
                s[e, k * blocks : (k + 1) * blocks] = read(idx.scales[src.scale].file, src.scale).float()
        return Fp8Weight(q, s, ct.shape[1] // part)

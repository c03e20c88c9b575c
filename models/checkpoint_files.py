"""The files of a checkpoint directory, read lazily: config.json, the shard list, an index of every tensor from
the safetensors headers alone, and per-tensor (per-slice) reads on demand.

Knows no Hugging Face tensor names (models/checkpoint.py maps them). A build validates names, dtypes and shapes
from the index before any tensor data is read, then reads only the slices a rank keeps, one tensor at a time,
converting each to the engine dtype as it is copied out of the file mapping (docs/CHECKPOINTS.md). FP8 weights
are dequantized here, block by block (models/fp8.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from models.config import ConfigError, ModelConfig
from models.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    SUPPORTED,
    Fp8Error,
    Fp8Scheme,
    check_pair,
    dequantize,
    parse_quantization_config,
)
from models.safetensors_header import SafetensorsHeaderError, check_safetensors_header


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the problem and the fix."""


# safetensors dtype codes the importer reads (FP8 only with its block scales) and the torch names of the rest
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TORCH_NAMES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F64": "float64", "I8": "int8", "U8": "uint8",
                "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool", "F32": "float32", "F16": "float16",
                "BF16": "bfloat16"}  # fmt: skip

Bounds = tuple[tuple[int, int], ...]  # [start, stop) per dim


@dataclass(frozen=True, slots=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code ("BF16", "F8_E4M3", ...)
    shape: tuple[int, ...]
    scale: str = ""  # an FP8 weight's companion `<name>_scale_inv` ("" for float weights)


@dataclass
class CheckpointIndex:
    """What a checkpoint holds, from config.json and the shard headers; no tensor data has been read."""

    path: Path
    config: ModelConfig
    hf_config: dict
    tensors: dict[str, TensorInfo]  # the weights (FP8 scales folded into their weight's `scale`)
    scales: dict[str, TensorInfo]  # `<name>_scale_inv` tensors of FP8 weights
    fp8: Fp8Scheme | None  # the quantization_config of config.json, None when it has none


def read_model_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """(validated ModelConfig, raw Hugging Face dict) from config.json alone: no weight file is opened."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"checkpoint {path} is a file, not a directory; pass --checkpoint DIR (the directory "
                              "holding config.json and the safetensors files)")  # fmt: skip
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; pass --checkpoint DIR with config.json")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json; a Hugging Face checkpoint directory needs one")
    try:
        hf = json.loads(cfg_file.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); fix or re-export the checkpoint") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {cfg_file}: {e.strerror}; check its permissions") from e
    try:
        return ModelConfig.from_hf_dict(hf), hf
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def weight_files(path: Path) -> list[Path]:
    """The shard files: those model.safetensors.index.json names (checked to exist), else model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            raw = json.loads(index.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not valid JSON ({e}); fix it or re-save the checkpoint") from e
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f'{index} has no "weight_map" object (tensor name -> shard file name); fix it or '
                                  "re-save the checkpoint")  # fmt: skip
        root = path.resolve()
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).resolve().is_relative_to(root):
                raise CheckpointError(f"{index} names shard {shard!r} outside the checkpoint directory; shards must "
                                      "sit next to the index")  # fmt: skip
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards named in {index.name} are missing: {missing}; copy them next to it")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json; save with safetensors")


def index_checkpoint(path: str | Path) -> CheckpointIndex:
    """Config, quantization scheme and every tensor's (file, dtype, shape), each header bounds-checked first."""
    path = Path(path)
    config, hf = read_model_config(path)
    try:
        fp8 = parse_quantization_config(hf)
    except Fp8Error as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e
    entries: dict[str, TensorInfo] = {}
    for file in weight_files(path):
        try:
            header = check_safetensors_header(file)
        except SafetensorsHeaderError as e:
            raise CheckpointError(str(e)) from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in entries:
                raise CheckpointError(f"tensor {name} is in both {entries[name].file.name} and {file.name}; remove "
                                      "the duplicate or re-save the checkpoint")  # fmt: skip
            entries[name] = TensorInfo(file, info["dtype"], tuple(info["shape"]))
    scales = {n: t for n, t in entries.items() if n.endswith(SCALE_SUFFIX)}
    tensors = {n: t for n, t in entries.items() if n not in scales}
    for name in sorted(scales):
        weight = tensors.get(name.removesuffix(SCALE_SUFFIX))
        if weight is None or weight.dtype != FP8_DTYPE:
            what = "is absent" if weight is None else f"is {_torch_name(weight.dtype)}, not float8_e4m3fn"
            raise CheckpointError(f"tensor {name} in {scales[name].file.name} scales {name.removesuffix(SCALE_SUFFIX)}"
                                  f", which {what}; remove the stray scale or re-download the checkpoint")  # fmt: skip
    for name, t in tensors.items():
        tensors[name] = _checked(path, name, t, scales, fp8)
    return CheckpointIndex(path, config, hf, tensors, scales, fp8)


def _torch_name(code: str) -> str:
    return _TORCH_NAMES.get(code, code)


def _checked(path: Path, name: str, t: TensorInfo, scales: dict[str, TensorInfo], fp8: Fp8Scheme | None) -> TensorInfo:
    if t.dtype in FLOAT_DTYPES:
        return t
    if t.dtype != FP8_DTYPE:
        raise CheckpointError(
            f"tensor {name} in {t.file.name} has dtype {_torch_name(t.dtype)}; the importer reads float32, float16 or "
            f"bfloat16 weights, or float8_e4m3fn ones with block scales ({SUPPORTED}): dequantize the checkpoint "
            "or use its float release"
        )
    scale = scales.get(name + SCALE_SUFFIX)
    if fp8 is None:
        raise CheckpointError(f"tensor {name} in {t.file.name} is float8_e4m3fn but {path / 'config.json'} has no "
                              'quantization_config; add {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": '
                              '[128, 128], "activation_scheme": "dynamic"} if that is how it was quantized')  # fmt: skip
    if scale is None:
        raise CheckpointError(f"tensor {name} in {t.file.name} is float8_e4m3fn but its block scale "
                              f"{name}{SCALE_SUFFIX} is missing; re-download the checkpoint (every FP8 weight ships "
                              "with one)")  # fmt: skip
    try:
        check_pair(name, t.shape, scale.dtype, scale.shape, fp8.block)
    except Fp8Error as e:
        raise CheckpointError(str(e)) from e
    return TensorInfo(t.file, t.dtype, t.shape, name + SCALE_SUFFIX)


def bounds_of(region: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Bounds:
    """[start, stop) per dim of a region (None: the whole tensor); only unit-step slices."""
    region = region or ()
    if len(region) > len(shape) or any(s.step not in (None, 1) for s in region):
        raise ValueError(f"region {region} does not fit shape {shape} (one unit-step slice per leading dim)")
    out = [s.indices(n)[:2] for s, n in zip(region, shape, strict=False)]
    return tuple((a, max(a, b)) for a, b in out) + tuple((0, n) for n in shape[len(region) :])


def _view(file: Path, name: str, bounds: Bounds) -> torch.Tensor:
    """The slice as a tensor over the file mapping (safetensors maps the file; only its pages are touched)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_slice(name)[tuple(slice(a, b) for a, b in bounds)]
    except Exception as e:  # safetensors raises its own error type (and OSError); the header check ran first
        raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {e}); re-download or re-save it") from e


def read_tensor(idx: CheckpointIndex, name: str, bounds: Bounds | None = None, dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One tensor (or its [start, stop) window) in `dtype`, owned (not the file mapping), checked finite.

    FP8 weights are dequantized with the scale blocks the window touches. With `out`, the values are copied
    into it (a slot of a fused expert stack) and no other tensor of that size is allocated.
    """
    info = idx.tensors[name]
    bounds = bounds if bounds is not None else tuple((0, n) for n in info.shape)
    src = _view(info.file, name, bounds)
    if info.scale:
        assert idx.fp8 is not None  # index_checkpoint refused FP8 weights without a scheme
        (r0, r1), (c0, c1) = bounds
        bm, bn = idx.fp8.block
        scale_bounds = ((r0 // bm, max(r0 // bm, -(-r1 // bm))), (c0 // bn, max(c0 // bn, -(-c1 // bn))))
        scale = _view(idx.scales[info.scale].file, info.scale, scale_bounds)
        src = dequantize(src, scale, r0, c0, idx.fp8.block)  # owned float32; the fp8 mapping is dropped
    bad = _non_finite(src)
    if bad:
        raise CheckpointError(f"tensor {name} in {info.file.name} has {bad} NaN/Inf values (of {src.numel()}): the "
                              "checkpoint is damaged or comes from a diverged run; re-export it from a good copy")  # fmt: skip
    if out is None:
        out = torch.empty(src.shape, dtype=dtype or src.dtype)
    return out.copy_(src)


def _non_finite(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i : i + chunk])).sum()) for i in range(0, flat.numel(), chunk))


@dataclass(frozen=True, slots=True)
class Piece:
    """One checkpoint tensor inside a canonical tensor."""

    source: str
    offset: tuple[int, ...]  # where the source's first element sits, one entry per canonical dim
    stacked: bool = False  # the source is one entry along canonical dim 0 (an expert of a fused stack)


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]  # they tile `shape` (models/checkpoint.py checks it from the index)


def materialize(idx: CheckpointIndex, ct: CanonicalTensor, bounds: Bounds, dtype: torch.dtype) -> torch.Tensor:
    """The [start, stop) window of a canonical tensor in `dtype`; pieces outside the window are never read."""
    out = torch.empty([b - a for a, b in bounds], dtype=dtype)
    for p in ct.pieces:
        shape = idx.tensors[p.source].shape
        extent = ((1,) if p.stacked else ()) + shape
        inter = [(max(o, a), min(o + n, b)) for o, n, (a, b) in zip(p.offset, extent, bounds, strict=True)]
        if any(lo >= hi for lo, hi in inter):
            continue
        src = tuple((lo - o, hi - o) for (lo, hi), o in zip(inter, p.offset, strict=True))
        dst = out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, bounds, strict=True))]
        if p.stacked:
            read_tensor(idx, p.source, src[1:], out=dst[0])
        else:
            read_tensor(idx, p.source, src, out=dst)
    return out

"""Bounds checks of a safetensors file's header (the 8-byte length, the JSON table, every tensor's byte range).

Run before the safetensors reader opens a file, so a truncated, corrupt or absurd file is named with the tensor
and the numbers instead of failing deep inside the reader (or trying to allocate what the header claims).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path


class SafetensorsHeaderError(ValueError):
    """A safetensors file whose header is damaged; the message names the file, the tensor and the fix."""


# safetensors dtype codes -> bits per element (the format's full list, so a valid file is never called corrupt)
_ST_DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
                  "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
                  "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}  # fmt: skip
_ST_MAX_HEADER = 100 << 20  # the limit the safetensors library itself enforces


def check_safetensors_header(file: Path) -> dict:
    """Parse and bounds-check a safetensors header, so damage is named here instead of deep in the reader."""
    size = file.stat().st_size
    fix = "re-download or re-save the checkpoint"
    if size < 8:
        raise SafetensorsHeaderError(f"{file} is truncated ({size} bytes): a safetensors file starts with an 8-byte header "
                              f"length; {fix}")  # fmt: skip
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8 or n > _ST_MAX_HEADER:
            raise SafetensorsHeaderError(f"{file}: header length {n} is larger than the file ({size} bytes) or the 100 MiB "
                                  f"safetensors limit: the file is corrupt or not safetensors; {fix}")  # fmt: skip
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsHeaderError(f"{file}: header is not valid JSON ({e}): the file is corrupt; {fix}") from e
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{file}: header is not a JSON object: the file is corrupt; {fix}")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise SafetensorsHeaderError(f"{file}: header entry for tensor {name} is malformed ({info!r}); {fix}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _ST_DTYPE_BITS:
            raise SafetensorsHeaderError(f"{file}: tensor {name} has unknown dtype {dtype!r}: the file is corrupt; {fix}")
        ints = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
        ints = ints and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in [*shape, *offsets])
        if not ints or offsets[0] > offsets[1]:
            raise SafetensorsHeaderError(f"{file}: tensor {name} has a bad shape {shape!r} or data_offsets {offsets!r}; {fix}")
        nbytes = (math.prod(shape) * _ST_DTYPE_BITS[dtype] + 7) // 8
        if offsets[1] - offsets[0] != nbytes:
            raise SafetensorsHeaderError(
                f"{file}: tensor {name} has dtype {dtype} and shape {shape} ({nbytes} bytes) but its data_offsets "
                f"span {offsets[1] - offsets[0]} bytes: the header is corrupt; {fix}"
            )
        if 8 + n + offsets[1] > size:
            raise SafetensorsHeaderError(f"{file} is truncated: tensor {name} needs bytes up to {8 + n + offsets[1]} but the "
                                  f"file has {size}; {fix}")  # fmt: skip
    return header

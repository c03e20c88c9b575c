"""The paged KV pool: its geometry, allocation, and how a kernel gets a view of it from an address.

Layout (one contiguous tensor, row-major):

    pool[plane, kv, block, slot, kv_head, head_dim]
         plane in 0..num_planes-1   main layer i -> plane i; MTP module j -> plane num_hidden_layers + j
         kv    in {0: K, 1: V} (kv_kind 0, GQA); only {0: latent} for kv_kind 1 (MLA)
         block in 0..num_blocks-1   block 0 is the reserved null/dummy block (never handed to a request)
         slot  in 0..block_size-1   position p of a request lives in block table[p // B], slot p % B

An MLA pool (kv_kind 1: DeepSeek-V2/V3, GLM-4.7-Flash) caches one latent row per position instead of
per-head K and V: `[k_pe (rope dims, roped) ; c_kv (kv_lora_rank)]`, stored with num_kv_heads = 1 and
head_dim = latent_dim. Its keys are the whole latent and its values the c_kv part (plugins/mla_ops.py).

Plugin nodes take the pool *by address* (an int64 tensor of shape [1]) plus this geometry as
attributes; ONNX Runtime Python custom ops receive copies of tensor inputs, so a pool passed as a tensor
would be copied per layer per step (see docs/ENGINE_FORMAT.md).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}


@dataclass(frozen=True, slots=True)
class KVPoolGeometry:
    num_planes: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int  # latent_dim for an MLA pool
    dtype_code: int = 0
    kv_kind: int = 0  # 0: K and V per KV head (GQA); 1: one MLA latent row per position (num_kv_heads = 1)

    def __post_init__(self) -> None:
        if self.kv_kind not in (0, 1):
            raise ValueError(f"kv_kind {self.kv_kind} is neither 0 (GQA K/V) nor 1 (MLA latent)")
        if self.kv_kind == 1 and self.num_kv_heads != 1:
            raise ValueError(f"an MLA pool (kv_kind 1) has num_kv_heads 1, got {self.num_kv_heads}")

    @property
    def kv_planes(self) -> int:
        """Entries of the pool's second axis: K and V (2), or the MLA latent alone (1)."""
        return 2 if self.kv_kind == 0 else 1

    @property
    def dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.dtype_code]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_planes, self.kv_planes, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def attrs(self) -> dict[str, int]:
        """The geometry as plugin-node attributes (names match the ONNX/TensorRT node contract).

        MLA nodes have no num_kv_heads (it is 1) and call head_dim `latent_dim`; kv_kind is implied by the node.
        """
        if self.kv_kind == 1:
            return {"num_planes": self.num_planes, "num_blocks": self.num_blocks, "block_size": self.block_size,
                    "latent_dim": self.head_dim, "dtype": self.dtype_code}  # fmt: skip
        return {
            "num_planes": self.num_planes,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype_code,
        }


def allocate_pool(geom: KVPoolGeometry, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.zeros(geom.shape, dtype=geom.dtype, device=device)


def pool_address(pool: torch.Tensor) -> torch.Tensor:
    """The pool's address as the int64[1] tensor plugin ops take (always on CPU: it is metadata)."""
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be contiguous: plugin kernels index it by raw offsets")
    return torch.tensor([pool.data_ptr()], dtype=torch.int64)


class _CudaArray:
    """Minimal __cuda_array_interface__ wrapper so torch can view device memory by address."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


def view_pool(ptr: int, geom: KVPoolGeometry, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor view over the pool memory at `ptr` (no copy). The caller guarantees the memory is alive.

    Views are cached per (address, geometry, device): every layer of every step asks for the same pool. A
    cached view owns nothing; it is only a typed window on that address, used while its op runs.
    """
    return _view_pool(ptr, geom, str(device))


def plane_kv(ptr: int, geom: KVPoolGeometry, plane: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU views of one plane's K and V as [num_blocks * block_size, Hkv, D]: a flat slot indexes a position.

    An MLA pool (kv_kind 1) has no V: both views are the latent plane [num_blocks * block_size, 1, latent_dim].
    """
    return _plane_views(ptr, geom)[plane]


@functools.lru_cache(maxsize=16)
def _plane_views(ptr: int, geom: KVPoolGeometry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pool = view_pool(ptr, geom)
    rows = geom.num_blocks * geom.block_size
    with torch.inference_mode(False):
        views = [pool[p, i].view(rows, geom.num_kv_heads, geom.head_dim) for p in range(geom.num_planes)
                 for i in range(geom.kv_planes)]  # fmt: skip
    if geom.kv_kind == 1:
        return [(lat, lat) for lat in views]
    return [(views[2 * p], views[2 * p + 1]) for p in range(geom.num_planes)]


@functools.lru_cache(maxsize=16)
def _view_pool(ptr: int, geom: KVPoolGeometry, device: str) -> torch.Tensor:
    if ptr == 0:
        raise ValueError("KV pool address is 0: the engine passed no pool")
    with torch.inference_mode(False):  # a cached view made under inference mode could not be written outside it
        return _make_view(ptr, geom, device)


def _make_view(ptr: int, geom: KVPoolGeometry, device: str) -> torch.Tensor:
    dev = torch.device(device)
    if dev.type == "cuda":
        raw = torch.as_tensor(_CudaArray(ptr, (geom.nbytes,), "|u1"), device=dev)
    else:
        buf = (ctypes.c_uint8 * geom.nbytes).from_address(ptr)
        raw = torch.from_numpy(np.frombuffer(memoryview(buf), dtype=np.uint8))
    return raw.view(geom.dtype).view(geom.shape)

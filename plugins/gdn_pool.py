"""The Gated DeltaNet state pool: its geometry, allocation, and views of it from an address.

Two contiguous tensors, one slot axis shared by every GDN layer (runtime/core/state_pool.py hands out the slots):

    conv[layer, slot, conv_dim, conv_kernel - 1]          the last K-1 conv inputs (the model's dtype)
    ssm [layer, slot, num_v_heads, head_k_dim, head_v_dim] the recurrent state (always float32)

`mtp::gdn_step` takes both pools *by address* (int64[1] tensors) plus this geometry as attributes, and writes the
states of its layer in place, exactly as the KV write ops take the KV pool (plugins/kv_pool.py): ONNX Runtime Python
ops receive copies of their tensor inputs, so a pool passed as a tensor would be copied per layer per step and the
writes lost. The geometry is recorded in an engine's config.json (`state`, models/engine_format/layout.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from plugins.kv_pool import CODE_DTYPES, _CudaArray


@dataclass(frozen=True, slots=True)
class GDNPoolGeometry:
    num_layers: int  # GDN layers (main layer order)
    num_slots: int  # max_batch x (K + 2) (runtime/core/state_pool.py)
    conv_dim: int  # 2 * Hk * Dk + Hv * Dv
    conv_kernel: int  # K of the causal conv; the window holds K - 1 inputs
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    dtype_code: int = 0  # the conv window's element type (0 fp32, 1 fp16, 2 bf16); the ssm state is always fp32

    def __post_init__(self) -> None:
        if self.conv_dim != 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim:
            raise ValueError(f"conv_dim {self.conv_dim} != 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim")
        if self.conv_kernel < 2 or self.num_v_heads % self.num_k_heads:
            raise ValueError(f"conv_kernel {self.conv_kernel} < 2 or num_v_heads {self.num_v_heads} is not a "
                             f"multiple of num_k_heads {self.num_k_heads}")  # fmt: skip

    @property
    def conv_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_slots, self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @property
    def dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.dtype_code]

    def attrs(self, layer: int) -> dict[str, int]:
        """The geometry as `GdnStep` node attributes (names match the ONNX / TensorRT node contract)."""
        return {"layer": layer, "num_layers": self.num_layers, "num_slots": self.num_slots, "conv_dim": self.conv_dim,
                "conv_kernel": self.conv_kernel, "num_k_heads": self.num_k_heads, "num_v_heads": self.num_v_heads,
                "head_k_dim": self.head_k_dim, "head_v_dim": self.head_v_dim, "dtype": self.dtype_code}  # fmt: skip


def allocate_state(geom: GDNPoolGeometry, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, ssm), zeroed. A fresh sequence never reads its slot (the op starts it from zeros), so zeros are not
    needed for correctness; they keep a dump readable."""
    return (torch.zeros(geom.conv_shape, dtype=geom.dtype, device=device),
            torch.zeros(geom.ssm_shape, dtype=torch.float32, device=device))  # fmt: skip


def address(pool: torch.Tensor) -> torch.Tensor:
    """A pool's address as the int64[1] (CPU) tensor `mtp::gdn_step` takes."""
    if not pool.is_contiguous():
        raise ValueError("the GDN state pool must be contiguous: the op indexes it by raw offsets")
    return torch.tensor([pool.data_ptr()], dtype=torch.int64)


def layer_views(conv_ptr: int, ssm_ptr: int, geom: GDNPoolGeometry, layer: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Views (no copy) of one layer's conv [S, C, K-1] and ssm [S, Hv, Dk, Dv] pools; the caller keeps them alive."""
    if not 0 <= layer < geom.num_layers:
        raise ValueError(f"GDN layer {layer} is outside the state pool's {geom.num_layers} layers")
    conv, ssm = _views(conv_ptr, ssm_ptr, geom, str(device))
    return conv[layer], ssm[layer]


@functools.lru_cache(maxsize=16)
def _views(conv_ptr: int, ssm_ptr: int, geom: GDNPoolGeometry, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    if conv_ptr == 0 or ssm_ptr == 0:
        raise ValueError("GDN state pool address is 0: the engine passed no state pool")
    with torch.inference_mode(False):  # a cached view made under inference mode could not be written outside it
        return (_view(conv_ptr, geom.conv_shape, geom.dtype, device),
                _view(ssm_ptr, geom.ssm_shape, torch.float32, device))  # fmt: skip


def _view(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    dev = torch.device(device)
    if dev.type == "cuda":
        raw = torch.as_tensor(_CudaArray(ptr, (nbytes,), "|u1"), device=dev)
    else:
        raw = torch.from_numpy(np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)), dtype=np.uint8))
    return raw.view(dtype).view(shape)

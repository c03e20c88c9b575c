"""`mtp::swa_paged_attention`: the paged attention op's sliding-window mode with attention sinks (MiMo-V2-Flash).

Its schema and CPU kernel are C++ (plugins/csrc/swa_paged_attention.cpp over attention.h's loops, shared with
`mtp::paged_attention`); this module checks that schema against the op spec (plugins/op_spec.py) and registers the
fake, and adds the CUDA implementation: the Triton paged attention kernel in its window + sinks mode
(plugins/triton_kernels.py, tested under TRITON_INTERPRET=1 only), which the TensorRT plugin (plugins/_trt_impl.py,
type-checked only: never built or run, docs/MODELS.md "MiMo-V2-Flash") launches too. Semantics: plugins/reference_swa.py.
"""

from __future__ import annotations

import torch

import plugins.cpp_ops  # noqa: F401  (defines the mtp:: schemas and registers the C++ CPU kernels)
from plugins.kv_pool import KVPoolGeometry
from plugins.op_backends import define_torch
from plugins.op_spec import SPECS

define_torch(SPECS["swa_paged_attention"])


@torch.library.impl("mtp::swa_paged_attention", "CUDA")
def _(q, q_counts, kv_lens, block_tables, pool_ptr, after, sinks, plane, num_planes, num_blocks, block_size,
      num_kv_heads, head_dim, dtype, scale, window):  # fmt: skip
    from plugins.triton_kernels import paged_attention_triton

    geom = KVPoolGeometry(num_planes, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return paged_attention_triton(q, q_counts, kv_lens, block_tables, int(pool_ptr[0]), plane, geom, scale,
                                  window=window, sinks=sinks)  # fmt: skip

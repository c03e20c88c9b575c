"""The KV layout of an engine: pool geometry plus block-table width, computed once by `table_width`.

The builder computes a `KVLayout` from its options and records it in config.json (`kv`); the runtime
reads it back and sizes every block table with the same `table_width` function (runtime/core/config.py),
so the width the graphs and TensorRT profiles were built for and the width the scheduler can produce
cannot disagree (they once did: ceil(L/B) in the builder vs ceil((L+2k)/B) in the runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plugins.kv_pool imports torch; the control plane reads layouts without it
    from plugins.gdn_pool import GDNPoolGeometry
    from plugins.kv_pool import KVPoolGeometry


def cdiv(a: int, b: int) -> int:
    """Ceiling division (the one copy: block counts everywhere)."""
    return -(-a // b)


def table_width(max_seq_len: int, num_draft_tokens: int, block_size: int) -> int:
    """Blocks a request may own: max_seq_len positions plus the MTP lookahead.

    A step verifying k drafts at the last position before max_seq_len writes main KV up to
    max_seq_len - 1 + k and MTP KV up to k - 1 positions further (runtime/core/scheduler.py
    `lookahead_tokens`), so 2k positions past max_seq_len bound every write.
    """
    return cdiv(max_seq_len + 2 * num_draft_tokens, block_size)


def default_num_blocks(max_batch: int, width: int) -> int:
    """Every request at full width at once, plus the reserved null block 0."""
    return max_batch * width + 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """config.json `kv`: what the plugin nodes were built to index, and how wide a block table may be."""

    block_size: int  # positions per block
    num_blocks: int  # pool blocks baked into the plugin nodes (block 0 is the null block)
    num_planes: int  # main layers, then MTP modules
    num_kv_heads: int  # 1 for an MLA pool
    head_dim: int  # latent_dim (qk_rope_head_dim + kv_lora_rank) for an MLA pool
    dtype_code: int  # 0 fp32, 1 fp16, 2 bf16 (plugins/kv_pool.py DTYPE_CODES)
    table_width: int  # block-table columns = table_width(max_seq_len, K, block_size)
    kv_kind: int = 0  # 0 K/V per KV head (GQA), 1 one MLA latent per position (plugins/kv_pool.py)

    @classmethod
    def plan(cls, *, num_planes: int, num_kv_heads: int, head_dim: int, dtype_code: int, block_size: int,
             max_batch: int, max_seq_len: int, num_draft_tokens: int, kv_kind: int = 0) -> KVLayout:  # fmt: skip
        width = table_width(max_seq_len, num_draft_tokens, block_size)
        return cls(block_size, default_num_blocks(max_batch, width), num_planes, num_kv_heads, head_dim, dtype_code,
                   width, kv_kind)  # fmt: skip

    def geometry(self, num_blocks: int | None = None) -> KVPoolGeometry:
        """The pool geometry, optionally with another block count (only the ORT executor may change it)."""
        from plugins.kv_pool import KVPoolGeometry

        blocks = self.num_blocks if num_blocks is None else num_blocks
        return KVPoolGeometry(self.num_planes, blocks, self.block_size, self.num_kv_heads, self.head_dim,
                              self.dtype_code, self.kv_kind)  # fmt: skip


# Hybrid prefix caching's default state snapshots per request of max_batch (runtime/core/config.py RuntimeConfig,
# and the snapshot slots a compiled hybrid engine's packages are built with: builder/compile_aoti.py).
SNAPSHOTS_PER_REQUEST = 4


@dataclass(frozen=True, slots=True)
class StateLayout:
    """config.json `state` (hybrid Gated DeltaNet models only): the state pool the GdnStep nodes were built to index.

    Each running request owns `slots_per_request` = K + 2 slots (runtime/core/state_pool.py: the committed state plus
    one per verify row), so the pool holds max_batch x (K + 2) slots; the executor allocates exactly this."""

    num_layers: int  # GDN layers
    slots_per_request: int  # K + 2
    num_slots: int  # limits.max_batch * slots_per_request
    conv_dim: int  # conv window rows: 2 * Hk * Dk + Hv * Dv
    conv_kernel: int  # K of the causal conv: the window holds conv_kernel - 1 inputs
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int  # the ssm state per layer and slot is [num_v_heads, head_k_dim, head_v_dim]
    head_v_dim: int
    dtype_code: int  # the conv window's element type (the engine dtype); the ssm state is always float32

    @classmethod
    def plan(cls, geom: GDNPoolGeometry, max_batch: int, num_draft_tokens: int) -> StateLayout:
        """From the model's pool geometry (models/gdn.py `state_geometry`; its slot count is replaced)."""
        per = num_draft_tokens + 2
        return cls(geom.num_layers, per, max_batch * per, geom.conv_dim, geom.conv_kernel, geom.num_k_heads,
                   geom.num_v_heads, geom.head_k_dim, geom.head_v_dim, geom.dtype_code)  # fmt: skip

    def geometry(self) -> GDNPoolGeometry:
        from plugins.gdn_pool import GDNPoolGeometry

        return GDNPoolGeometry(self.num_layers, self.num_slots, self.conv_dim, self.conv_kernel, self.num_k_heads,
                               self.num_v_heads, self.head_k_dim, self.head_v_dim, self.dtype_code)  # fmt: skip

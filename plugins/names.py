"""Plugin node names, their ONNX domain and versions: the one list every exporter, executor and check reads.

`plugins/onnx_export.py` emits these nodes, `plugins/ort_ops.py` binds them for ONNX Runtime,
`plugins/trt_plugins.py` registers TensorRT creators for `TRT_PLUGIN_NODES`, and an engine's config.json
records `installed_plugins()` so a runtime with other plugin versions refuses it.
"""

from __future__ import annotations

from typing import Any

DOMAIN = "mtp"  # ONNX domain of the plugin nodes = the TensorRT plugin namespace
OPSET_VERSION = 1  # version of that ONNX domain
PLUGIN_VERSION = "1"  # TensorRT plugin version string carried by every node

KV_WRITE = "KvWrite"
PAGED_ATTENTION = "PagedAttention"
MOE_EXPERTS = "MoeExperts"
# MLA latent KV (plugins/mla_ops.py): an MLA pool (kv_kind 1) is read and written only by these two.
MLA_KV_WRITE = "MlaKvWrite"
MLA_PAGED_ATTENTION = "MlaPagedAttention"
MLA_NODES = (MLA_KV_WRITE, MLA_PAGED_ATTENTION)
# Gated DeltaNet token mixing of hybrid models (plugins/gdn_ops.py): reads and writes the GDN state pool
# (plugins/gdn_pool.py) and carries that pool's geometry as attributes.
GDN_STEP = "GdnStep"
# PagedAttention's sliding-window mode with per-head attention sinks (MiMo-V2-Flash's SWA layers; plugins/swa_ops.py).
SWA_PAGED_ATTENTION = "SwaPagedAttention"
# DeepSeek Sparse Attention (plugins/dsa_ops.py): the indexer's top-k over an indexer-key plane of the latent pool, and
# the absorbed MLA attention over the selected positions of a latent plane. Read the pool only.
DSA_INDEX_TOPK = "DsaIndexTopk"
DSA_SPARSE_ATTENTION = "DsaSparseAttention"
DSA_NODES = (DSA_INDEX_TOPK, DSA_SPARSE_ATTENTION)
PLUGIN_NODES = (KV_WRITE, PAGED_ATTENTION, MOE_EXPERTS, *MLA_NODES, GDN_STEP, SWA_PAGED_ATTENTION, *DSA_NODES)
# MoeExperts has no TensorRT plugin yet (its ep_size > 1 form needs NCCL). GdnStep, SwaPagedAttention and the DSA
# nodes have plugins that are type-checked only (no TensorRT nor GPU here: docs/MODELS.md).
TRT_PLUGIN_NODES = (KV_WRITE, PAGED_ATTENTION, *MLA_NODES, GDN_STEP, SWA_PAGED_ATTENTION, *DSA_NODES)
# Nodes that index the KV pool and therefore carry its geometry as attributes (latent-pool ones call head_dim
# latent_dim).
POOL_NODES = (KV_WRITE, PAGED_ATTENTION, *MLA_NODES, SWA_PAGED_ATTENTION, *DSA_NODES)
# The pool nodes of an MLA latent pool (kv_kind 1): the latent row length is their latent_dim (DsaIndexTopk: row_dim).
LATENT_POOL_NODES = (*MLA_NODES, *DSA_NODES)

# Not an ONNX graph node: the compiled (AOTInductor) packages call it for bf16-stored dense weights.
LINEAR_BF16 = "LinearBf16"

# Tensor-parallel collectives (plugins/collectives.py semantics; docs/ENGINE_FORMAT.md "Collective nodes"):
# AllReduce sums over the TP comm, AllGather concatenates along the last axis in rank order; attribute tp_size.
# Emitted only into tp_size > 1 graphs; TensorRT plugins in plugins/trt_collectives.py (NCCL).
ALL_REDUCE = "AllReduce"
ALL_GATHER = "AllGather"
COLLECTIVE_NODES = (ALL_REDUCE, ALL_GATHER)


def installed_plugins() -> dict[str, Any]:
    """Plugin names and versions this installation executes (what an engine must have been built with)."""
    nodes = {name: PLUGIN_VERSION for name in (*PLUGIN_NODES, *COLLECTIVE_NODES)}
    return {"namespace": DOMAIN, "onnx_opset": OPSET_VERSION, "nodes": nodes}

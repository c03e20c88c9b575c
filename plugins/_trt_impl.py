"""TensorRT IPluginV3 classes for the plugin nodes. Imports `tensorrt`: load only through plugins/trt_plugins.py.

Plugins: KvWrite, PagedAttention (GQA pool), SwaPagedAttention (its sliding-window + sinks mode, MiMo-V2-Flash),
MlaKvWrite, MlaPagedAttention (MLA latent pool, kv_kind 1), DsaIndexTopk, DsaSparseAttention (DeepSeek Sparse
Attention over that pool) and GdnStep (the Gated DeltaNet state pool, plugins/gdn_pool.py). GdnStep, SwaPagedAttention
and the DSA plugins are type-checked against tensorrt-stubs only: no TensorRT engine holding them has been built or
run, and their Triton kernels have run only in the CPU interpreter (no GPU here; mtp-build refuses --backend tensorrt
for those models).

Each plugin names its node and op spec and writes its output types and shapes and `enqueue`, which launches the
Triton launchers (plugins/triton_kernels.py, mla_triton.py, dsa_triton.py, gdn_triton.py) on TensorRT's stream over
TensorRT's buffers; the shared machinery (capabilities, fields, format checks, the cached pool address) is
plugins/_trt_base.py.
"""

from __future__ import annotations

import tensorrt as trt
import torch

from plugins._trt_base import _as_tensor, _CreatorBase, _DeviceArray, _PluginBase
from plugins.dsa_triton import dsa_index_topk_triton, dsa_sparse_attention_triton
from plugins.gdn_pool import GDNPoolGeometry, layer_views
from plugins.gdn_triton import gdn_step_triton
from plugins.kv_pool import KVPoolGeometry
from plugins.mla_ops import mla_geometry
from plugins.mla_triton import mla_kv_write_triton, mla_paged_attention_triton
from plugins.names import (
    DSA_INDEX_TOPK,
    DSA_SPARSE_ATTENTION,
    GDN_STEP,
    KV_WRITE,
    MLA_KV_WRITE,
    MLA_PAGED_ATTENTION,
    PAGED_ATTENTION,
    SWA_PAGED_ATTENTION,
)
from plugins.op_spec import SPECS
from plugins.triton_kernels import kv_write_triton, paged_attention_triton


class KvWritePlugin(_PluginBase):
    """KvWrite: inputs k, v, counts, starts, block_tables, pool_ptr; output int64[1] rows stored."""

    name = KV_WRITE
    spec = SPECS["kv_write"]
    pool_input = 5

    def get_output_data_types(self, input_types: list[trt.DataType]) -> list[trt.DataType]:
        return [trt.DataType.INT64]

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        out = trt.DimsExprs(1)
        out[0] = expr_builder.constant(1)
        return [out]


    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        k, v, counts, starts, tables = (_as_tensor(inputs[i], input_desc[i]) for i in range(5))
        written = _as_tensor(outputs[0], output_desc[0])
        pool = self._pool_address(inputs[self.pool_input])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            kv_write_triton(k, v, counts, starts, tables, pool, self.plane, self.geom,
                            int(self.values["rope_dim"]), self.values["rope_theta"], out=written)  # fmt: skip


class PagedAttentionPlugin(_PluginBase):
    """PagedAttention: inputs q, q_counts, kv_lens, block_tables, pool_ptr, after; output like q."""

    name = PAGED_ATTENTION
    spec = SPECS["paged_attention"]
    pool_input = 4

    def get_output_data_types(self, input_types: list[trt.DataType]) -> list[trt.DataType]:
        return [input_types[0]]

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        return [trt.DimsExprs([inputs[0][i] for i in range(len(inputs[0]))])]


    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        q, q_counts, kv_lens, tables = (_as_tensor(inputs[i], input_desc[i]) for i in range(4))
        out = _as_tensor(outputs[0], output_desc[0])
        pool = self._pool_address(inputs[self.pool_input])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            paged_attention_triton(q, q_counts, kv_lens, tables, pool, self.plane, self.geom,
                                   self.values["scale"], out=out)  # fmt: skip


class MlaKvWritePlugin(_PluginBase):
    """MlaKvWrite: inputs latent, counts, starts, block_tables, pool_ptr, inv_freq; output int64[1] rows stored."""

    name = MLA_KV_WRITE
    spec = SPECS["mla_kv_write"]
    pool_input = 4

    def _geometry(self, v: dict[str, int]) -> KVPoolGeometry:
        return mla_geometry(v["num_planes"], v["num_blocks"], v["block_size"], v["latent_dim"], v["dtype"])

    def get_output_data_types(self, input_types: list[trt.DataType]) -> list[trt.DataType]:
        return [trt.DataType.INT64]

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        out = trt.DimsExprs(1)
        out[0] = expr_builder.constant(1)
        return [out]


    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        latent, counts, starts, tables = (_as_tensor(inputs[i], input_desc[i]) for i in range(4))
        inv_freq = _as_tensor(inputs[5], input_desc[5])
        written = _as_tensor(outputs[0], output_desc[0])
        pool = self._pool_address(inputs[self.pool_input])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            mla_kv_write_triton(latent, counts, starts, tables, pool, inv_freq, self.plane, self.geom,
                                int(self.values["rope_dim"]), self.values["rope_scale"], out=written)  # fmt: skip


class MlaPagedAttentionPlugin(_PluginBase):
    """MlaPagedAttention: inputs q, q_counts, kv_lens, block_tables, pool_ptr, after; output [T, H, latent - rope]."""

    name = MLA_PAGED_ATTENTION
    spec = SPECS["mla_paged_attention"]
    pool_input = 4

    def _geometry(self, v: dict[str, int]) -> KVPoolGeometry:
        return mla_geometry(v["num_planes"], v["num_blocks"], v["block_size"], v["latent_dim"], v["dtype"])

    def get_output_data_types(self, input_types: list[trt.DataType]) -> list[trt.DataType]:
        return [input_types[0]]

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        value_dim = self.geom.head_dim - int(self.values["rope_dim"])  # the c_kv part of the latent
        return [trt.DimsExprs([inputs[0][0], inputs[0][1], expr_builder.constant(value_dim)])]


    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        q, q_counts, kv_lens, tables = (_as_tensor(inputs[i], input_desc[i]) for i in range(4))
        out = _as_tensor(outputs[0], output_desc[0])
        pool = self._pool_address(inputs[self.pool_input])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            mla_paged_attention_triton(q, q_counts, kv_lens, tables, pool, self.plane, self.geom,
                                       int(self.values["rope_dim"]), self.values["scale"], out=out)  # fmt: skip


class SwaPagedAttentionPlugin(PagedAttentionPlugin):
    """SwaPagedAttention: inputs q, q_counts, kv_lens, block_tables, pool_ptr, after, sinks; output like q. The paged
    attention kernel in its window + sinks mode (plugins/triton_kernels.py; semantics plugins/reference_swa.py)."""

    name = SWA_PAGED_ATTENTION
    spec = SPECS["swa_paged_attention"]
    pool_input = 4

    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        q, q_counts, kv_lens, tables = (_as_tensor(inputs[i], input_desc[i]) for i in range(4))
        sinks = _as_tensor(inputs[6], input_desc[6])
        out = _as_tensor(outputs[0], output_desc[0])
        pool = self._pool_address(inputs[self.pool_input])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            paged_attention_triton(q, q_counts, kv_lens, tables, pool, self.plane, self.geom, self.values["scale"],
                                   out=out, window=int(self.values["window"]), sinks=sinks)  # fmt: skip


class DsaIndexTopkPlugin(_PluginBase):
    """DsaIndexTopk: inputs q, weights, q_counts, kv_lens, block_tables, pool_ptr; output int64 [T, topk]. The scores
    scratch (fp32 [T, max_blocks * block_size], plugins/dsa_triton.py) is TensorRT's workspace, sized for the
    largest T and block-table width of the profile."""

    name = DSA_INDEX_TOPK
    spec = SPECS["dsa_index_topk"]
    pool_input = 5

    def _geometry(self, v: dict[str, int]) -> KVPoolGeometry:
        return mla_geometry(v["num_planes"], v["num_blocks"], v["block_size"], v["row_dim"], v["dtype"])

    def get_output_data_types(self, input_types: list[trt.DataType]) -> list[trt.DataType]:
        return [trt.DataType.INT64]

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        return [trt.DimsExprs([inputs[0][0], expr_builder.constant(int(self.values["topk"]))])]

    def get_workspace_size(self, inp: list[trt.DynamicPluginTensorDesc], out: list[trt.DynamicPluginTensorDesc]) -> int:
        rows, columns = int(inp[0].max[0]), int(inp[4].max[1])
        return rows * columns * self.geom.block_size * 4

    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        q, weights, q_counts, kv_lens, tables = (_as_tensor(inputs[i], input_desc[i]) for i in range(5))
        out = _as_tensor(outputs[0], output_desc[0])
        shape = (q.shape[0], tables.shape[1] * self.geom.block_size)
        scratch = torch.as_tensor(_DeviceArray(workspace, shape, "<f4"), device="cuda") if shape[0] * shape[1] else None
        pool = self._pool_address(inputs[self.pool_input])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            dsa_index_topk_triton(q, weights, q_counts, kv_lens, tables, pool, self.plane, self.geom,
                                  int(self.values["topk"]), self.values["scale"], out=out,
                                  scratch=scratch)  # fmt: skip


class DsaSparseAttentionPlugin(MlaPagedAttentionPlugin):
    """DsaSparseAttention: inputs q, q_counts, selected, block_tables, pool_ptr; output [T, H, latent - rope]. The
    latent pool's geometry and output shape of MlaPagedAttention, over the selected positions only."""

    name = DSA_SPARSE_ATTENTION
    spec = SPECS["dsa_sparse_attention"]

    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        q, q_counts, selected, tables = (_as_tensor(inputs[i], input_desc[i]) for i in range(4))
        out = _as_tensor(outputs[0], output_desc[0])
        pool = self._pool_address(inputs[self.pool_input])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            dsa_sparse_attention_triton(q, q_counts, selected, tables, pool, self.plane, self.geom,
                                        int(self.values["rope_dim"]), self.values["scale"], out=out)  # fmt: skip


class GdnStepPlugin(_PluginBase):
    """GdnStep: inputs mixed, b, a, q_counts, starts, read_slots, write_slots, conv_pool_ptr, ssm_pool_ptr,
    conv_weight, a_log, dt_bias; output float32 [T, Hv, Dv]. Writes its layer's state slots through the addresses."""

    name = GDN_STEP
    spec = SPECS["gdn_step"]
    pool_input = 7  # conv_pool_ptr; ssm_pool_ptr is the next input

    def _geometry(self, v: dict[str, int]) -> GDNPoolGeometry:
        return GDNPoolGeometry(v["num_layers"], v["num_slots"], v["conv_dim"], v["conv_kernel"], v["num_k_heads"],
                               v["num_v_heads"], v["head_k_dim"], v["head_v_dim"], v["dtype"])  # fmt: skip

    def get_output_data_types(self, input_types: list[trt.DataType]) -> list[trt.DataType]:
        return [trt.DataType.FLOAT]

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        hv, dv = expr_builder.constant(self.geom.num_v_heads), expr_builder.constant(self.geom.head_v_dim)
        return [trt.DimsExprs([inputs[0][0], hv, dv])]

    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        mixed, b, a, q_counts, starts, read_slots, write_slots = (_as_tensor(inputs[i], input_desc[i]) for i in range(7))
        conv_weight, a_log, dt_bias = (_as_tensor(inputs[i], input_desc[i]) for i in range(9, 12))
        out = _as_tensor(outputs[0], output_desc[0])
        conv_ptr, ssm_ptr = (self._pool_address(inputs[i]) for i in (self.pool_input, self.pool_input + 1))
        conv, ssm = layer_views(conv_ptr, ssm_ptr, self.geom, self.plane, "cuda")
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            # the launcher allocates its result; one copy into TensorRT's output buffer (an out= form would save it)
            out.copy_(gdn_step_triton(mixed, b, a, q_counts, starts, read_slots, write_slots, conv, ssm, conv_weight,
                                      a_log, dt_bias, self.geom.num_k_heads, self.geom.head_k_dim,
                                      self.geom.head_v_dim))  # fmt: skip


class KvWriteCreator(_CreatorBase):
    plugin_cls = KvWritePlugin


class PagedAttentionCreator(_CreatorBase):
    plugin_cls = PagedAttentionPlugin


class MlaKvWriteCreator(_CreatorBase):
    plugin_cls = MlaKvWritePlugin


class MlaPagedAttentionCreator(_CreatorBase):
    plugin_cls = MlaPagedAttentionPlugin


class SwaPagedAttentionCreator(_CreatorBase):
    plugin_cls = SwaPagedAttentionPlugin


class DsaIndexTopkCreator(_CreatorBase):
    plugin_cls = DsaIndexTopkPlugin


class DsaSparseAttentionCreator(_CreatorBase):
    plugin_cls = DsaSparseAttentionPlugin


class GdnStepCreator(_CreatorBase):
    plugin_cls = GdnStepPlugin


def creators() -> list[trt.IPluginCreatorV3One]:
    """One creator per name in TRT_PLUGIN_NODES, in that order."""
    return [KvWriteCreator(), PagedAttentionCreator(), MlaKvWriteCreator(), MlaPagedAttentionCreator(), GdnStepCreator(),
            SwaPagedAttentionCreator(), DsaIndexTopkCreator(), DsaSparseAttentionCreator()]

"""The machinery every TensorRT IPluginV3 plugin shares (plugins/_trt_impl.py; plugins/trt_collectives.py uses its
fields and tensor wrapping). Imports `tensorrt`: load only through plugins/trt_plugins.py / trt_collectives.py.

`_PluginBase` is one object implementing the core, build and runtime capabilities; subclasses name their node and
op spec and write `get_output_data_types`, `get_output_shapes` and `enqueue`. `_as_tensor` wraps TensorRT's device
pointers as torch tensors (no copy). Attributes arrive as plugin fields named like the ONNX node attributes
(`_fields` / `_read_fields`), and the format checks are the op spec's (plugins/op_spec.py `accepts`).

Pool address: a node's `pool_ptr` input (GdnStep: `conv_pool_ptr`, `ssm_pool_ptr`) is an int64[1] *device* tensor.
Reading it needs a device-to-host copy, so the plugin reads it once per binding address (at the warm-up enqueue that
must precede graph capture) and caches it; the runtime keeps the pool and that buffer fixed for the engine's life.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorrt as trt
import torch

from plugins.kv_pool import KVPoolGeometry
from plugins.names import DOMAIN, PLUGIN_VERSION
from plugins.op_spec import OpSpec, accepts

_TYPE_NAMES = {trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16", trt.DataType.BF16: "bfloat16",
               trt.DataType.INT32: "int32", trt.DataType.INT64: "int64"}  # fmt: skip
# __cuda_array_interface__ has no bf16 typestr: bf16 is wrapped as int16 and reinterpreted.
_TYPESTR = {trt.DataType.FLOAT: "<f4", trt.DataType.HALF: "<f2", trt.DataType.BF16: "<i2",
            trt.DataType.INT32: "<i4", trt.DataType.INT64: "<i8"}  # fmt: skip


class _DeviceArray:
    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


def _as_tensor(ptr: int, desc: trt.PluginTensorDesc) -> torch.Tensor:
    shape = tuple(int(desc.dims[i]) for i in range(len(desc.dims)))
    t = torch.as_tensor(_DeviceArray(ptr, shape, _TYPESTR[desc.type]), device="cuda")
    return t.view(torch.bfloat16) if desc.type == trt.DataType.BF16 else t


def _fields(spec: OpSpec, values: dict[str, float]) -> trt.PluginFieldCollection:
    fields = []
    for attr in spec.attrs:
        # FallbackString: the binding's name type (implicitly converted from str at runtime; explicit for mypy).
        name, key = attr.name, trt.FallbackString(attr.name)
        if attr.kind is float:
            fields.append(trt.PluginField(key, np.array([values[name]], np.float32), trt.PluginFieldType.FLOAT32))
        else:
            fields.append(trt.PluginField(key, np.array([values[name]], np.int32), trt.PluginFieldType.INT32))
    return trt.PluginFieldCollection(fields)


def _read_fields(spec: OpSpec, fc: trt.PluginFieldCollection_) -> dict[str, float]:
    """Plugin fields -> attribute values. The ONNX parser may hand ints as INT32 or INT64 and floats as
    FLOAT32 or FLOAT64, and adds the routing strings: take the first element of each known field."""
    known = {a.name for a in spec.attrs}
    values: dict[str, float] = {}
    for i in range(len(fc)):
        f = fc[i]
        if f.name in known:
            values[f.name] = float(np.asarray(f.data).reshape(-1)[0])
    missing = known - values.keys()
    if missing:
        raise ValueError(f"plugin fields missing: {sorted(missing)}")
    return values


class _CorePlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
    """What every plugin of the namespace states alike: identity, fields from its OpSpec, no tactics, no workspace."""

    name = ""
    spec: OpSpec

    def __init__(self, values: dict[str, float]) -> None:
        trt.IPluginV3.__init__(self)
        trt.IPluginV3OneCore.__init__(self)
        trt.IPluginV3OneBuild.__init__(self)
        trt.IPluginV3OneRuntime.__init__(self)
        self.plugin_name = self.name
        self.plugin_version = PLUGIN_VERSION
        self.plugin_namespace = DOMAIN
        self.num_outputs = 1
        self.timing_cache_id = f"{DOMAIN}::{self.name}::{PLUGIN_VERSION}"  # deterministic, no tactics
        self.metadata_string = ""
        self.format_combination_limit = trt.IPluginV3OneBuild.DEFAULT_FORMAT_COMBINATION_LIMIT
        self.values = dict(values)

    def get_capability_interface(self, type: trt.PluginCapabilityType) -> Any:
        return self

    def clone(self) -> trt.IPluginV3:
        return type(self)(self.values)

    def get_fields_to_serialize(self) -> trt.PluginFieldCollection_:
        return trt.PluginFieldCollection_(_fields(self.spec, self.values))

    def configure_plugin(self, inp: list[trt.DynamicPluginTensorDesc], out: list[trt.DynamicPluginTensorDesc]) -> None:
        return None

    def on_shape_change(self, inp: list[trt.PluginTensorDesc], out: list[trt.PluginTensorDesc]) -> None:
        return None

    def set_tactic(self, tactic: int) -> None:
        return None

    def get_valid_tactics(self) -> list[int]:
        return []

    def get_workspace_size(self, inp: list[trt.DynamicPluginTensorDesc], out: list[trt.DynamicPluginTensorDesc]) -> int:
        return 0

    def attach_to_context(self, resource_context: Any) -> trt.IPluginV3:
        return self.clone()


class _PluginBase(_CorePlugin):
    """A pool plugin: the pool's geometry from its attributes and its address read through the *_ptr input."""

    pool_input = 0

    def __init__(self, values: dict[str, float]) -> None:
        super().__init__(values)
        self._pool_cache: dict[int, int] = {}  # address of a *_ptr buffer -> the pool address stored there
        floats = {a.name for a in self.spec.attrs if a.kind is float}
        v = {k: int(x) for k, x in values.items() if k not in floats}
        self.plane = v.get("plane", v.get("layer", 0))  # GdnStep: the layer of the state pool
        self.geom = self._geometry(v)

    def _geometry(self, v: dict[str, int]) -> Any:
        return KVPoolGeometry(v["num_planes"], v["num_blocks"], v["block_size"], v["num_kv_heads"], v["head_dim"],
                              v["dtype"])  # fmt: skip

    def _pool_address(self, buffer_ptr: int) -> int:
        """The pool address stored at device address `buffer_ptr` (read once per buffer; see module doc)."""
        if buffer_ptr not in self._pool_cache:
            host = torch.empty(1, dtype=torch.int64)
            host.copy_(torch.as_tensor(_DeviceArray(buffer_ptr, (1,), "<i8"), device="cuda"))
            self._pool_cache[buffer_ptr] = int(host[0])
        return self._pool_cache[buffer_ptr]

    def supports_format_combination(self, pos: int, in_out: list[trt.DynamicPluginTensorDesc], num_inputs: int) -> bool:
        """Linear tensors whose types the op's spec accepts (plugins/op_spec.py `accepts`)."""
        if in_out[pos].desc.format != trt.TensorFormat.LINEAR:
            return False
        types = [_TYPE_NAMES.get(d.desc.type, "other") for d in in_out[: pos + 1]]
        return accepts(self.spec, pos, types)


class _CreatorBase(trt.IPluginCreatorV3One):
    plugin_cls: type[_PluginBase] = _PluginBase

    def __init__(self) -> None:
        trt.IPluginCreatorV3One.__init__(self)
        self.name = self.plugin_cls.name
        self.plugin_namespace = DOMAIN
        self.plugin_version = PLUGIN_VERSION
        spec = self.plugin_cls.spec
        self.field_names = trt.PluginFieldCollection_(_fields(spec, {a.name: 0 for a in spec.attrs}))

    def create_plugin(self, name: str, field_collection: trt.PluginFieldCollection_, phase: Any) -> trt.IPluginV3:
        return self.plugin_cls(_read_fields(self.plugin_cls.spec, field_collection))

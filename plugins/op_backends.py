"""Every backend's view of a plugin op, derived from its OpSpec (plugins/op_spec.py). Nothing here names an op.

* torch        the schema (defined here unless a kernel library already defined it: then it must be the same)
               and the fake from the spec's shape rule; kernels register themselves (C++, Triton, Python)
* ONNX         the node schema in domain `mtp` and the exporter's translation of `torch.ops.mtp.<op>`
* ONNX Runtime an onnxruntime-extensions Python op that calls the torch op (or its numpy kernel in ORT_KERNELS)
* TensorRT     the format checks (op_spec.accepts, called by plugins/_trt_impl.py)

`install(spec)` does the torch, ONNX and ONNX Runtime parts for one spec; `install_all()` for every registered spec.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

import plugins.cpp_ops  # noqa: F401  (the C++ kernel library defines its ops' schemas first)
from plugins.names import DOMAIN, OPSET_VERSION, PLUGIN_VERSION
from plugins.op_spec import FLOAT, FP32, INDEX, INT64, SPECS, OpSpec

_installed: set[str] = set()
# Ops whose ONNX Runtime kernel is not their torch op: numpy functions (inputs..., attrs...) -> output, set by the
# module that owns the op before plugins/ort_ops.py installs the ORT ops (the collectives: plugins/collectives.py).
ORT_KERNELS: dict[str, Callable[..., Any]] = {}


def install(spec: OpSpec, cpu: Callable[..., torch.Tensor] | None = None) -> None:
    """Make `spec` an op of every backend (idempotent). cpu: a Python CPU kernel, for ops without a C++ one."""
    if spec.op in _installed:
        return
    define_torch(spec, cpu)
    register_onnx_schema(spec)
    _ort(spec)
    _installed.add(spec.op)


def install_all() -> None:
    for spec in list(SPECS.values()):
        install(spec)


# ---------------------------------------------------------------------------------------------------- torch
def define_torch(spec: OpSpec, kernel: Callable[..., torch.Tensor] | None = None, key: str = "CPU") -> None:
    """The torch op of `spec`: its schema (unless a kernel library defined it: then it must be the spec's), its
    fake, and optionally a Python kernel for dispatch key `key` ("CompositeExplicitAutograd": any device)."""
    qualname = f"mtp::{spec.op}"
    packet = getattr(torch.ops.mtp, spec.op) if _schema_exists(qualname) else None
    if packet is None:
        torch.library.define(qualname, spec.torch_schema.removeprefix(spec.op))
    elif _normal(str(packet.default._schema)) != _normal(f"mtp::{spec.torch_schema}"):
        raise RuntimeError(f"{qualname} is defined as {packet.default._schema}, but its spec says "
                           f"mtp::{spec.torch_schema} (plugins/op_spec.py is the one source)")  # fmt: skip
    if kernel is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key):
        torch.library.impl(qualname, key)(kernel)
    if not _has_fake(qualname):
        names = [a.name for a in spec.attrs]
        n = len(spec.inputs)

        def fake(*args, **kwargs):
            return spec.shape(*args[:n], **dict(zip(names, args[n:], strict=False)), **kwargs)

        torch.library.register_fake(qualname)(fake)


def _schema_exists(qualname: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False


def _has_fake(qualname: str) -> bool:
    from torch._library.simple_registry import singleton

    return singleton.find(qualname).fake_impl.kernel is not None or torch._C._dispatch_has_kernel_for_dispatch_key(
        qualname, "Meta")  # fmt: skip


def _normal(schema: str) -> str:
    return schema.replace(" ", "").replace("SymInt", "int")  # custom_op declares ints as SymInt


# ---------------------------------------------------------------------------------------------------- ONNX
_ONNX_TYPES = {FLOAT: ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], INDEX: ["tensor(int32)", "tensor(int64)"],
               INT64: ["tensor(int64)"], FP32: ["tensor(float)"]}  # fmt: skip
_PLUGIN_ATTRS = (("plugin_namespace", "TensorRT plugin namespace (always 'mtp')"),
                 ("plugin_version", "TensorRT plugin version (always '1')"))  # fmt: skip


def onnx_schema(spec: OpSpec):
    from onnx.defs import OpSchema

    kinds = {int: OpSchema.AttrType.INT, float: OpSchema.AttrType.FLOAT}
    variables: dict[str, list[str]] = {}

    def param(t) -> OpSchema.FormalParameter:
        option = OpSchema.FormalParameterOption.Optional if t.optional else OpSchema.FormalParameterOption.Single
        if t.dtype == FLOAT:
            var = t.type_var or "T"
            variables[var] = _ONNX_TYPES[FLOAT]
            return OpSchema.FormalParameter(t.name, var, t.shape, param_option=option)
        if t.dtype == INDEX:
            variables["I"] = _ONNX_TYPES[INDEX]
            return OpSchema.FormalParameter(t.name, "I", t.shape, param_option=option)
        return OpSchema.FormalParameter(t.name, _ONNX_TYPES[t.dtype][0], t.shape, param_option=option)

    inputs, outputs = [param(t) for t in spec.inputs], [param(t) for t in spec.outputs]
    attributes = [OpSchema.Attribute(a.name, kinds[a.kind], a.doc, required=True) for a in spec.attrs]
    attributes += [OpSchema.Attribute(n, OpSchema.AttrType.STRING, d, required=False) for n, d in _PLUGIN_ATTRS]
    constraints = [(var, types, f"{var} tensors") for var, types in variables.items()]
    return OpSchema(spec.node, DOMAIN, OPSET_VERSION, spec.doc, inputs=inputs, outputs=outputs,
                    type_constraints=constraints, attributes=attributes)  # fmt: skip


def register_onnx_schema(spec: OpSpec) -> None:
    import onnx

    if not onnx.defs.has(spec.node, DOMAIN):
        onnx.defs.register_schema(onnx_schema(spec))


def translation(spec: OpSpec) -> Callable[..., Any]:
    """The exporter's translation of the torch op: one `mtp` node with the attributes and the plugin routing.

    torch.onnx reads the function's signature (attributes are the annotated int / float parameters), so the
    function gets the spec's signature."""
    names = [t.name for t in spec.inputs] + [a.name for a in spec.attrs]

    def translate(*args, **kwargs):
        import onnxscript

        bound = dict(zip(names, args, strict=False)) | kwargs
        attrs = {a.name: a.kind(bound.get(a.name, a.default)) for a in spec.attrs}
        node = getattr(onnxscript.values.Opset(DOMAIN, OPSET_VERSION), spec.node)
        return node(*(bound[t.name] for t in spec.inputs), **attrs, plugin_namespace=DOMAIN,
                    plugin_version=PLUGIN_VERSION)  # fmt: skip

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(t.name, kind) for t in spec.inputs]
    params += [inspect.Parameter(a.name, kind, annotation=a.kind,
                                 default=inspect.Parameter.empty if a.default is None else a.default)
               for a in spec.attrs]  # fmt: skip
    translate.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    translate.__annotations__ = {a.name: a.kind for a in spec.attrs}
    translate.__name__ = translate.__qualname__ = f"translate_{spec.op}"
    return translate


def custom_translation_table() -> dict[Any, Callable[..., Any]]:
    """`custom_translation_table=` for `torch.onnx.export(..., dynamo=True)`: every spec's op -> its node (the
    kernels' modules must be imported first: plugins/onnx_export.py does)."""
    install_all()
    return {getattr(torch.ops.mtp, s.op).default: translation(s) for s in SPECS.values()}


# ---------------------------------------------------------------------------------------------------- ONNX Runtime
ORT_DOMAIN = "ai.onnx.contrib"  # the only domain onnxruntime-extensions' Python ops live in


def _ort(spec: OpSpec) -> None:
    import numpy as np
    from onnxruntime_extensions import PyOp, onnx_op

    # Python custom ops take one fixed type per input: the graphs' fp32 rows and int32 metadata.
    types = {FLOAT: PyOp.dt_float, INDEX: PyOp.dt_int32, INT64: PyOp.dt_int64, FP32: PyOp.dt_float}
    attr_types = {a.name: PyOp.dt_int64 if a.kind is int else PyOp.dt_float for a in spec.attrs}
    # The TensorRT routing strings are declared too so that nodes carrying them are accepted.
    attr_types |= {"plugin_namespace": PyOp.dt_string, "plugin_version": PyOp.dt_string}

    def run(*inputs, **attrs):
        values = [a.kind(attrs[a.name]) for a in spec.attrs]
        if spec.op in ORT_KERNELS:
            return ORT_KERNELS[spec.op](*inputs, *values)
        tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]
        return getattr(torch.ops.mtp, spec.op)(*tensors, *values).numpy()

    run.__name__ = f"{spec.op}_ort"
    onnx_op(op_type=spec.node, inputs=[types[t.dtype] for t in spec.inputs],
            outputs=[types[t.dtype] for t in spec.outputs], attrs=attr_types)(run)  # fmt: skip

"""TensorRT IPluginV3 plugins for the tensor-parallel collective nodes `AllReduce` / `AllGather` over NCCL.

NEVER EXECUTED on the machine this repository is developed and tested on (no GPU, no TensorRT, no NCCL):
the code is written against the documented TensorRT 10 IPluginV3 Python API and the documented
`torch.distributed` NCCL backend, and type-checked by mypy (TensorRT stubs); `mtp-build --tp-size N --backend
tensorrt` is refused until it has run on GPUs. Imports `tensorrt` at the top: load it only where TensorRT is
installed (like plugins/_trt_impl.py).

Semantics are those of the ONNX Runtime ops (plugins/ort_ops.py) and the torch ops (plugins/collectives.py):
AllReduce sums x over the TP group; AllGather concatenates x along its last axis in rank order. NCCL runs in
the tensor's own dtype (fp16/bf16/fp32), unlike the CPU transport (fp32 on the wire).

Communicators: `nccl_tp_group(tp_size)` initializes the default process group once per process (rank and world
from MPI.COMM_WORLD; the rendezvous address is broadcast from rank 0 over MPI) and creates every TP group in
the same order on every rank, as `torch.distributed.new_group` requires. Call it at start-up on every rank,
before building or deserializing an engine that holds these nodes. Each `enqueue` runs on TensorRT's stream
(torch.cuda.ExternalStream), so the collective is ordered with the engine's other kernels; with CUDA graphs
NCCL must be captured in the same (graph-safe) mode on every rank.
"""

from __future__ import annotations

import socket
from typing import Any

import tensorrt as trt
import torch
import torch.distributed as dist

from plugins._trt_base import _TYPE_NAMES, _as_tensor, _CorePlugin, _fields, _read_fields
from plugins.names import ALL_GATHER, ALL_REDUCE, DOMAIN, PLUGIN_VERSION
from plugins.op_spec import SPECS, accepts

_TP_GROUPS: dict[int, Any] = {}


def nccl_tp_group(tp_size: int) -> Any:
    """This rank's TP process group (ranks dp_rank*tp .. dp_rank*tp + tp - 1) on the NCCL backend, cached."""
    if tp_size in _TP_GROUPS:
        return _TP_GROUPS[tp_size]
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the MPI world size {size}")
    if not dist.is_initialized():
        address = None
        if rank == 0:
            with socket.socket() as s:  # a free port on rank 0's host; the other ranks learn it over MPI
                s.bind(("", 0))
                address = f"tcp://{socket.gethostbyname(socket.gethostname())}:{s.getsockname()[1]}"
        address = world.bcast(address, root=0)
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
        dist.init_process_group("nccl", init_method=address, rank=rank, world_size=size)
    mine = None
    for dp_rank in range(size // tp_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(dp_rank * tp_size, (dp_rank + 1) * tp_size)), backend="nccl")
        if rank // tp_size == dp_rank:
            mine = group
    _TP_GROUPS[tp_size] = mine
    return mine


class _CollectivePlugin(_CorePlugin):
    spec = SPECS["all_reduce"]  # AllGather's attributes (tp_size) and tensor types are AllReduce's

    def __init__(self, values: dict[str, float]) -> None:
        super().__init__(values)
        self.tp_size = int(values["tp_size"])

    def get_output_data_types(self, input_types: list[trt.DataType]) -> list[trt.DataType]:
        return [input_types[0]]

    def supports_format_combination(self, pos: int, in_out: list[trt.DynamicPluginTensorDesc], num_inputs: int) -> bool:
        if in_out[pos].desc.format != trt.TensorFormat.LINEAR:
            return False
        types = [_TYPE_NAMES.get(d.desc.type, "other") for d in in_out[: pos + 1]]
        return accepts(self.spec, pos, types)


class AllReducePlugin(_CollectivePlugin):
    """AllReduce: y = sum of x over the TP group (same shape and type)."""

    name = ALL_REDUCE

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        return [trt.DimsExprs([inputs[0][i] for i in range(len(inputs[0]))])]

    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        x, y = _as_tensor(inputs[0], input_desc[0]), _as_tensor(outputs[0], output_desc[0])
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            y.copy_(x)
            if y.numel():  # every rank has the same shape (TP ranks replay one schedule), so all skip together
                dist.all_reduce(y, op=dist.ReduceOp.SUM, group=nccl_tp_group(self.tp_size))


class AllGatherPlugin(_CollectivePlugin):
    """AllGather: y[..., r*N:(r+1)*N] = x of TP rank r (last axis N -> tp_size * N)."""

    name = ALL_GATHER

    def get_output_shapes(
        self, inputs: list[trt.DimsExprs], shape_inputs: list[trt.DimsExprs], expr_builder: trt.IExprBuilder
    ) -> list[trt.DimsExprs]:
        dims = [inputs[0][i] for i in range(len(inputs[0]))]
        dims[-1] = expr_builder.operation(trt.DimensionOperation.PROD, dims[-1], expr_builder.constant(self.tp_size))
        return [trt.DimsExprs(dims)]

    def enqueue(self, input_desc: list[trt.PluginTensorDesc], output_desc: list[trt.PluginTensorDesc],
                inputs: list[int], outputs: list[int], workspace: int, stream: int) -> None:  # fmt: skip
        x, y = _as_tensor(inputs[0], input_desc[0]), _as_tensor(outputs[0], output_desc[0])
        if not x.numel():
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            gathered = torch.empty((self.tp_size, *x.shape), dtype=x.dtype, device=x.device)  # rank-major
            dist.all_gather_into_tensor(gathered, x.contiguous(), group=nccl_tp_group(self.tp_size))
            y.view(*x.shape[:-1], self.tp_size, x.shape[-1]).copy_(gathered.movedim(0, -2))


class _CollectiveCreator(trt.IPluginCreatorV3One):
    plugin_cls: type[_CollectivePlugin] = _CollectivePlugin

    def __init__(self) -> None:
        trt.IPluginCreatorV3One.__init__(self)
        self.name = self.plugin_cls.name
        self.plugin_namespace = DOMAIN
        self.plugin_version = PLUGIN_VERSION
        self.field_names = trt.PluginFieldCollection_(_fields(SPECS["all_reduce"], {"tp_size": 0}))

    def create_plugin(self, name: str, field_collection: trt.PluginFieldCollection_, phase: Any) -> trt.IPluginV3:
        return self.plugin_cls(_read_fields(SPECS["all_reduce"], field_collection))


class AllReduceCreator(_CollectiveCreator):
    plugin_cls = AllReducePlugin


class AllGatherCreator(_CollectiveCreator):
    plugin_cls = AllGatherPlugin


def creators() -> list[trt.IPluginCreatorV3One]:
    """The creators to register under namespace `mtp` (plugins/trt_plugins.py registers the pool plugins)."""
    return [AllReduceCreator(), AllGatherCreator()]


_registered: list[Any] = []  # TensorRT keeps only a reference to each creator


def register_collectives() -> list[str]:
    """Register both creators in `trt.get_plugin_registry()` under namespace `mtp` (idempotent)."""
    if not _registered:
        registry = trt.get_plugin_registry()
        for creator in creators():
            if not registry.register_creator(creator, DOMAIN):
                raise RuntimeError(f"TensorRT refused to register plugin creator {creator.name} in {DOMAIN!r}")
            _registered.append(creator)
    return [ALL_REDUCE, ALL_GATHER]

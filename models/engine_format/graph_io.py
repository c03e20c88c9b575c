"""The graph I/O contract: names, dtypes and dims of every input and output of the three engine graphs.

One definition, read by the exporter (builder/export.py: input/output names, dynamic axes), the
TensorRT profiles (builder/trt_build.py: symbolic dim names), the load-time cross-check
(engine_format/directory.py: the ONNX files must declare exactly these) and the executors (`feeds`:
the per-step dataclasses of runtime/executors/base.py have one field per graph input, same name).

Dims: a string is a symbolic (dynamic) axis name, "H" and "V" are the model's hidden size and vocab size,
an int is fixed. Hidden states are float32 at graph boundaries whatever the engine dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from models.config import ModelConfig

GRAPH_NAMES = ("main", "mtp_draft", "mtp_commit")
DRAFT_GRAPH = "mtp_draft"  # module 0's draft graph; module j > 0 of a per-module family: f"{DRAFT_GRAPH}_{j}"
# Families whose draft depth d runs MTP module d (models/mimo_v2.py): one draft graph per module, all with
# mtp_draft's I/O contract. Every other family drafts with module 0 at every depth: one draft graph.
PER_MODULE_DRAFTS = ("mimo_v2_flash",)
POOL_INPUT = "kv_pool_ptr"  # int64[1] pool address, supplied by the executor (not a step field)
# Hybrid (Gated DeltaNet) main graphs also take the GDN state pools' addresses (plugins/gdn_pool.py).
STATE_INPUTS = ("conv_pool_ptr", "ssm_pool_ptr")
ADDRESS_INPUTS = (POOL_INPUT, *STATE_INPUTS)
MODEL_DIMS = ("H", "V")  # placeholders for ModelConfig.hidden_size / vocab_size

Dim = str | int


@dataclass(frozen=True, slots=True)
class GraphSpec:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dtypes: dict[str, str]  # every input and output -> numpy dtype name
    dims: dict[str, tuple[Dim, ...]]  # every input and output -> dims (see the module docstring)

    @property
    def dynamic(self) -> dict[str, dict[int, str]]:
        """Input name -> {axis: symbolic dim name}; the names are what optimization profiles bucket over."""
        return {n: {a: d for a, d in enumerate(self.dims[n]) if isinstance(d, str) and d not in MODEL_DIMS}
                for n in self.inputs}  # fmt: skip

    @property
    def step_inputs(self) -> tuple[str, ...]:
        """The inputs a step supplies (= the field names of the executor's input dataclass)."""
        return tuple(n for n in self.inputs if n not in ADDRESS_INPUTS)

    def concrete_dims(self, name: str, hidden_size: int, vocab_size: int) -> tuple[Dim, ...]:
        model = {"H": hidden_size, "V": vocab_size}
        return tuple(model.get(d, d) if isinstance(d, str) else d for d in self.dims[name])


_IO = list[tuple[str, str, tuple[Dim, ...]]]


def _spec(name: str, inputs: _IO, outputs: _IO) -> GraphSpec:
    io = inputs + outputs
    return GraphSpec(name, tuple(n for n, _, _ in inputs), tuple(n for n, _, _ in outputs),
                     {n: t for n, t, _ in io}, {n: d for n, _, d in io})  # fmt: skip


_I32, _I64, _F32 = "int32", "int64", "float32"
_BT = ("block_tables", _I32, ("requests", "max_blocks"))
_PTR = (POOL_INPUT, _I64, (1,))
SPECS: dict[str, GraphSpec] = {
    "main": _spec(
        "main",
        [("input_ids", _I64, ("tokens",)), ("positions", _I64, ("tokens",)), ("q_counts", _I32, ("requests",)),
         ("kv_lens", _I32, ("requests",)), _BT, ("logit_rows", _I64, ("logit_rows",)), _PTR],
        [("hidden", _F32, ("tokens", "H")), ("logits", _F32, ("logit_rows", "V"))],
    ),
    "mtp_draft": _spec(
        "mtp_draft",
        [("hidden_in", _F32, ("requests", "H")), ("token_ids", _I64, ("requests",)),
         ("positions", _I64, ("requests",)), ("counts", _I32, ("requests",)), _BT, _PTR],
        [("hidden_out", _F32, ("requests", "H")), ("logits", _F32, ("requests", "V"))],
    ),
    "mtp_commit": _spec(
        "mtp_commit",
        [("hidden_in", _F32, ("rows", "H")), ("token_ids", _I64, ("rows",)), ("counts", _I32, ("requests",)),
         ("starts", _I32, ("requests",)), _BT, _PTR],
        [("rows_written", _I64, (1,))],
    ),
}  # fmt: skip


# The K draft depths in one call (builder/fused_draft.py; issue 27): mtp_draft's inputs plus each row's draft count
# k_i (`depths`: a row at depth d >= k_i writes the null block), out the K in-graph argmax drafts per row. Not an ONNX
# graph: a compiled engine (K >= 2, one rank) stores it as kind FUSED_KIND of mtp_draft's entry in `graphs`.
FUSED_DRAFT = "mtp_draft_fused"
FUSED_KIND = "aoti_fused"
FUSED_DRAFT_SPEC = _spec(
    FUSED_DRAFT,
    [(n, SPECS[DRAFT_GRAPH].dtypes[n], SPECS[DRAFT_GRAPH].dims[n]) for n in SPECS[DRAFT_GRAPH].step_inputs]
    + [("depths", _I64, ("requests",)), _PTR],
    [("drafts", _I64, ("requests", "K"))],  # K: the engine's num_draft_tokens, fixed in the package
)

# The main graph of a hybrid model: plus the state slots each request reads / each row writes
# (runtime/executors/base.py HybridMainInput) and the state pools' addresses. Its draft and commit graphs are the
# plain ones: the MTP layer is full attention and needs no recurrent state.
HYBRID_MAIN = _spec(
    "main",
    [(n, SPECS["main"].dtypes[n], SPECS["main"].dims[n]) for n in SPECS["main"].step_inputs]
    + [("state_read_slots", _I32, ("requests",)), ("state_write_slots", _I32, ("tokens",)), _PTR,
       (STATE_INPUTS[0], _I64, (1,)), (STATE_INPUTS[1], _I64, (1,))],
    [(n, SPECS["main"].dtypes[n], SPECS["main"].dims[n]) for n in SPECS["main"].outputs],
)  # fmt: skip


def draft_graph(module: int) -> str:
    """The name of MTP module `module`'s draft graph."""
    return DRAFT_GRAPH if module == 0 else f"{DRAFT_GRAPH}_{module}"


def draft_graph_module(name: str) -> int | None:
    """The MTP module draft graph `name` runs; None when `name` is not a draft graph."""
    if name == DRAFT_GRAPH:
        return 0
    suffix = name.removeprefix(f"{DRAFT_GRAPH}_")
    return int(suffix) if suffix != name and suffix.isdigit() and suffix[0] != "0" else None


def draft_graphs(model: ModelConfig) -> tuple[str, ...]:
    """The draft graphs an engine of `model` has: one per MTP module for PER_MODULE_DRAFTS, else `mtp_draft` alone
    (none without MTP modules). The executors pick one per depth (runtime/executors/base.py draft_module)."""
    if not model.num_mtp_modules:
        return ()
    modules = model.num_mtp_modules if model.model_type in PER_MODULE_DRAFTS else 1
    return tuple(draft_graph(j) for j in range(modules))


def engine_graphs(model: ModelConfig) -> tuple[str, ...]:
    """Every graph of one rank of an engine of `model`, in build order: main, the draft graphs, the commit graph."""
    return ("main", *draft_graphs(model), "mtp_commit") if model.num_mtp_modules else ("main",)


def graph_spec(name: str, hybrid: bool = False) -> GraphSpec:
    """The I/O contract of graph `name` (`hybrid`: of a model with Gated DeltaNet layers); every draft graph has
    mtp_draft's."""
    if hybrid and name == "main":
        return HYBRID_MAIN
    if name == FUSED_DRAFT:
        return FUSED_DRAFT_SPEC
    if name not in SPECS and draft_graph_module(name) is not None:
        return replace(SPECS[DRAFT_GRAPH], name=name)
    return SPECS[name]


def feeds(spec: GraphSpec, inp: Any) -> dict[str, np.ndarray]:
    """The graph's feed dict from a step dataclass: one field per input, cast to the contract dtype."""
    return {name: np.asarray(getattr(inp, name), spec.dtypes[name]) for name in spec.step_inputs}

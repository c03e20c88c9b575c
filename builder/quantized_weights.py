"""Weights the compiled packages store quantized, and the graph rewrites that read them (builder/compile_aoti.py runs
these on each exported program before `bf16_weights`).

FP8 checkpoints (DeepSeek-V3, GLM-4.5-FP8): the dense linears whose release weight is FP8 keep it, e4m3 bytes plus
the 128 x 128 block scales (`fp8_weights`, given the raw weights models.checkpoint.load_fp8_weights read), and call
`mtp::linear_fp8`, which converts in registers with fp32 math: exact up to summation order, 1 byte per weight;
routed experts call `mtp::moe_experts_fp8`.

`--quantize int8` (`int8_weights`): the dense linears' and the routed experts' fp32 weights are quantized
at build time, symmetric per output channel (plugins/reference.py quantize_int8; each expert's rows on their own),
stored int8 + fp32 scales and read by `mtp::linear_int8` / `mtp::moe_experts_int8` (fp32 math): 1 byte per weight,
lossy (the engine decodes its own quantized model, which `mtp-build --check` probes against).

`--quantize int4` (`int4_weights`, then `int8_weights` for the rest): the dense linears whose input width K is a
multiple of the group G (`--int4-group-size`, 64 by default) are stored as group-wise int4 (plugins/reference.py
quantize_int4: one fp32 scale per G input features of a row, two values per byte, 0.5 + 4 / G bytes per weight) and
read by `mtp::linear_int4`, and so are the routed experts whose input widths (H for w_gate_up, I for
w_down) G divides, read by `mtp::moe_experts_int4`; the other weights `--quantize int8` takes (linears and experts whose
widths the group does not divide) are stored int8 as there.

Expert and tensor parallelism (`--ep-size`, `--tp-size`): each rank's graph holds only its experts (its shard of the
[E, ...] stacks, models/sharding.py), and those are what a rank stores in the format: quantize_int8 and quantize_int4
scale each expert's rows on their own, so a rank's shard is stored exactly as the single-rank engine stores those
experts (an FP8 rank reads its own experts' FP8 blocks). Its multi-rank `mtp::moe_experts` (ep_size or tp_size > 1)
becomes the format's exchange op, `mtp::moe_experts_fp8_exchange` / `_int8_exchange` / `_int4_exchange`
(plugins/moe_ep.py): the same token exchange as the float one, each rank computing what it receives with the format's
local kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

import plugins.moe_ep  # noqa: F401  (defines the experts' exchange ops, mtp::moe_experts_<fmt>_exchange)
from models.fp8 import Fp8Weight
from plugins.reference import dequantize_fp8_experts_ref, dequantize_fp8_ref, quantize_int4, quantize_int8

LINEAR = torch.ops.aten.linear.default  # aten.linear, what export gives F.linear / nn.Linear


def fp8_weights(program: torch.export.ExportedProgram, fp8: Mapping[str, Fp8Weight],
                prefix: str = "model.") -> dict[str, int]:  # fmt: skip
    """Store the weights an FP8 release ships as FP8 (e4m3 + a new fp32 constant `<weight>_scale_inv`) and rewrite
    their uses: fp32 linears into `mtp::linear_fp8`, `mtp::moe_experts` into `mtp::moe_experts_fp8` (multi-rank:
    `mtp::moe_experts_fp8_exchange`). A parameter qualifies when its name (less the wrapper's `prefix`) is in `fp8`,
    its fp32 value is exactly the dequantized FP8 (checked: the model was loaded from the same checkpoint) and every
    use can be rewritten (an experts node needs both its weights); anything else keeps its float weight. Run it before
    `bf16_weights` (an FP8 weight is half the bytes of its bf16 form). Returns {"fp8_weights": weights stored FP8,
    "fp8_linears": linears rewritten, "fp8_experts": experts nodes rewritten}."""
    sig, graph = program.graph_signature, program.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    uses = _uses
    chosen: dict[torch.fx.Node, tuple[str, Fp8Weight]] = {}
    for node in placeholders:
        key = sig.inputs_to_parameters.get(node.name)
        raw = fp8.get(key.removeprefix(prefix)) if key else None
        value = program.state_dict.get(key) if key else None
        if raw is None or value is None or value.dtype != torch.float32 or value.shape != raw.weight.shape:
            continue
        deq = (dequantize_fp8_ref(raw.weight, raw.scale_inv) if raw.weight.dim() == 2
               else dequantize_fp8_experts_ref(raw.weight, raw.scale_inv, raw.parts))  # fmt: skip
        if uses(node) and torch.equal(deq, value.detach()):  # else not the checkpoint's FP8 values: keep it
            chosen[node] = (key, raw)
    while drop := [n for n in chosen if not all(_fp32_linear(u, n) or _experts_of(u, n, chosen) for u in uses(n))]:
        for n in drop:  # an experts node whose other weight is not FP8 keeps both float
            del chosen[n]
    scales = _store_quantized(program, {node: (key, raw.weight, raw.scale_inv, "_scale_inv")
                                        for node, (key, raw) in chosen.items()})  # fmt: skip
    linears, experts = _rewrite(program, scales, torch.ops.mtp.linear_fp8.default, _experts_ops("fp8"))
    return {"fp8_weights": len(chosen), "fp8_linears": linears, "fp8_experts": experts}


_EXPERTS = torch.ops.mtp.moe_experts.default


def _experts_ops(fmt: str) -> tuple[Any, Any]:
    """(single-rank op, exchange op) of the routed experts stored in `fmt`: `mtp::moe_experts_<fmt>` (C++) and
    `mtp::moe_experts_<fmt>_exchange` (plugins/moe_ep.py, which defines it)."""
    name = f"moe_experts_{fmt}"
    return getattr(torch.ops.mtp, name).default, getattr(torch.ops.mtp, f"{name}_exchange").default


def _rewrite(program: torch.export.ExportedProgram, scales: Mapping[torch.fx.Node, torch.fx.Node], linear_op: Any,
             experts_ops: tuple[Any, Any] | None = None,
             linear_extra: tuple[Any, ...] = ()) -> tuple[int, int]:  # fmt: skip
    """Point the uses of the weights just stored quantized (`scales`: weight -> its scale constant) at the ops that
    read them: each aten.linear over one becomes linear_op(x, w, scale, *linear_extra, bias), each `mtp::moe_experts`
    over a stored pair (experts_ops: its single-rank and exchange forms) single(x, ids, weights, gu, gu_scale, down,
    down_scale, *linear_extra, 0) (int4's group size, both ops) or, with ep_size or tp_size > 1, exchange(x, ids,
    weights, gu, gu_scale, down, down_scale, *linear_extra, num_experts, ep_size, tp_size, tp_rank). Returns
    (linears, experts nodes) rewritten."""
    graph = program.graph_module.graph
    linears = experts = 0
    for node in list(graph.nodes):
        args: tuple[Any, ...]
        if node.target is LINEAR and node.args[1] in scales:
            w = node.args[1]
            assert isinstance(w, torch.fx.Node)
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            args, op = (node.args[0], w, scales[w], *linear_extra, bias), linear_op
            linears += 1
        elif experts_ops is not None and node.target is _EXPERTS and node.args[3] in scales:
            x, ids, tw, gu, dn, num_experts, ep_size, *tp = node.args
            assert isinstance(gu, torch.fx.Node) and isinstance(dn, torch.fx.Node)
            tp_size, tp_rank = tp[0] if tp else 1, tp[1] if len(tp) > 1 else 0  # absent: the schema's defaults
            quantized = (x, ids, tw, gu, scales[gu], dn, scales[dn], *linear_extra)
            if ep_size == 1 and tp_size == 1:
                args, op = (*quantized, 0), experts_ops[0]
            else:
                args, op = (*quantized, num_experts, ep_size, tp_size, tp_rank), experts_ops[1]
            experts += 1
        else:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(op, args)
        new.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    program.graph_module.recompile()
    return linears, experts


def _uses(node: torch.fx.Node) -> list[torch.fx.Node]:
    """node's users but export's dtype checks (`_assert_tensor_metadata`)."""
    return [u for u in node.users if u.target is not torch.ops.aten._assert_tensor_metadata.default]


def _store_quantized(program: torch.export.ExportedProgram,
                     stored: Mapping[torch.fx.Node, tuple[str, torch.Tensor, torch.Tensor, str]]
                     ) -> dict[torch.fx.Node, torch.fx.Node]:  # fmt: skip
    """For each parameter placeholder -> (its state_dict key, the quantized weight, its scales, a suffix): store the
    weight in place of the float parameter and the scales as a new constant input `<key><suffix>` (placed before
    the user inputs, as export orders them). Drops export's fp32 checks of those weights (no longer true, by design).
    Returns placeholder -> its scales' placeholder; the caller rewrites the uses."""
    sig, graph = program.graph_signature, program.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_user = next((i for i, spec in enumerate(sig.input_specs) if spec.kind == InputKind.USER_INPUT),
                      len(placeholders))  # fmt: skip
    anchor = placeholders[first_user] if first_user < len(placeholders) else None
    fake = detect_fake_mode(tuple(n.meta["val"] for n in placeholders))
    scales: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, (key, weight, scale_value, suffix) in stored.items():
        program.state_dict[key] = torch.nn.Parameter(weight, requires_grad=False)
        node.meta["val"] = fake.from_tensor(weight, static_shapes=True) if fake else weight
        with graph.inserting_before(anchor) if anchor is not None else graph.inserting_after(placeholders[-1]):
            scale = scales[node] = graph.placeholder(f"{node.name}{suffix}")
        scale.target = scale.name
        scale.meta["val"] = fake.from_tensor(scale_value, static_shapes=True) if fake else scale_value
        target = f"{key}{suffix}"
        sig.input_specs.insert(first_user, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(scale.name), target))
        first_user += 1
        program.constants[target] = scale_value
        for user in [u for u in node.users if u not in _uses(node)]:
            graph.erase_node(user)
    return scales


# --quantize int8 leaves these float: the embeddings and the LM head (their error reaches every logit directly; the
# usual weight-only practice) and the MoE router (`mlp.gate`: its scores pick the experts, a flip changes the route).
# `--quantize-lm-head` takes the LM head out of the list (INT8_KEPT_FLOAT_BUT_HEAD): int8 in every quantized graph that
# has one (a tied LM head is an embedding too, and an embedding use is not a linear: it stays float).
INT8_KEPT_FLOAT = ("embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight")
INT8_KEPT_FLOAT_BUT_HEAD = tuple(name for name in INT8_KEPT_FLOAT if name != "lm_head.weight")


def int8_weights(program: torch.export.ExportedProgram, prefix: str = "model.",
                 kept_float: tuple[str, ...] = INT8_KEPT_FLOAT) -> dict[str, Any]:  # fmt: skip
    """`mtp-build --quantize int8`: store as int8 + one fp32 scale per output row (plugins/reference.py quantize_int8;
    the constant `<weight>_int8_scale`) every fp32 weight [N, K] whose uses are all fp32 linears (attention
    projections, dense MLPs, shared experts, eh_proj), rewritten into `mtp::linear_int8`, and every routed-experts
    pair (w_gate_up [E, 2I, H], w_down [E, H, I]; scales [E, 2I], [E, H]: a multi-rank graph's E are its own experts)
    of an `mtp::moe_experts` over fp32 x, rewritten into `mtp::moe_experts_int8` (multi-rank:
    `mtp::moe_experts_int8_exchange`; an experts node whose other weight cannot be quantized keeps both float). The
    weights named by `kept_float` stay float (by default the embeddings, the LM head and the router). Run it before
    `bf16_weights`. Returns {"int8_weights": count, "int8_linears": linears rewritten, "int8_experts": experts nodes
    rewritten, "int8_names": the quantized weights' names less `prefix` (the checkpoint's), for `mtp-build --check`}."""
    sig, graph = program.graph_signature, program.graph_module.graph
    chosen: dict[torch.fx.Node, tuple[str, torch.Tensor]] = {}
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        key = sig.inputs_to_parameters.get(node.name)
        value = program.state_dict.get(key) if key else None
        if value is None or value.dtype != torch.float32 or value.dim() not in (2, 3) or key.endswith(kept_float):
            continue
        if _uses(node):
            chosen[node] = (key, value.detach())

    def readable(use: torch.fx.Node, node: torch.fx.Node) -> bool:  # what the int8 ops compute
        return _fp32_linear(use, node) if chosen[node][1].dim() == 2 else _experts_of(use, node, chosen)

    while drop := [n for n in chosen if not all(readable(u, n) for u in _uses(n))]:
        for n in drop:  # an experts node whose other weight is not quantized keeps both float
            del chosen[n]
    scales = _store_quantized(program, {node: (key, *quantize_int8(value), "_int8_scale")
                                        for node, (key, value) in chosen.items()})  # fmt: skip
    linears, experts = _rewrite(program, scales, torch.ops.mtp.linear_int8.default, _experts_ops("int8"))
    names = sorted(key.removeprefix(prefix) for key, _ in chosen.values())
    return {"int8_weights": len(chosen), "int8_linears": linears, "int8_experts": experts, "int8_names": names}


def int4_weights(program: torch.export.ExportedProgram, group: int, prefix: str = "model.") -> dict[str, Any]:
    """`mtp-build --quantize int4`: store as group-wise int4 (plugins/reference.py quantize_int4, `group` input
    features per fp32 scale, `--int4-group-size`; the constant `<weight>_int4_scale`) every fp32 weight int8_weights
    would take whose input width (last dimension) the group divides: linears' [N, K], rewritten into
    `mtp::linear_int4`, and routed-experts pairs of an `mtp::moe_experts` (w_gate_up [E, 2I, H] and w_down [E, H, I],
    both or neither; scales [E, 2I, H/G], [E, H, I/G]), rewritten into `mtp::moe_experts_int4` (multi-rank:
    `mtp::moe_experts_int4_exchange`). Run it
    before `int8_weights`, which then takes the fp32 weights left (the linears and experts of other widths). Returns
    {"int4_weights": count, "int4_linears": linears rewritten, "int4_experts": experts nodes rewritten,
    "int4_names": the quantized weights' names less `prefix`}."""
    sig, graph = program.graph_signature, program.graph_module.graph
    chosen: dict[torch.fx.Node, tuple[str, torch.Tensor]] = {}
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        key = sig.inputs_to_parameters.get(node.name)
        value = program.state_dict.get(key) if key else None
        if value is None or value.dtype != torch.float32 or value.dim() not in (2, 3) or key.endswith(INT8_KEPT_FLOAT):
            continue
        if value.shape[-1] % group == 0 and _uses(node):
            chosen[node] = (key, value.detach())

    def readable(use: torch.fx.Node, node: torch.fx.Node) -> bool:  # what the int4 ops compute
        return _fp32_linear(use, node) if chosen[node][1].dim() == 2 else _experts_of(use, node, chosen)

    while drop := [n for n in chosen if not all(readable(u, n) for u in _uses(n))]:
        for n in drop:  # an experts node whose other weight's width the group does not divide: int8, both
            del chosen[n]
    scales = _store_quantized(program, {node: (key, *quantize_int4(value, group), "_int4_scale")
                                        for node, (key, value) in chosen.items()})  # fmt: skip
    linears, experts = _rewrite(program, scales, torch.ops.mtp.linear_int4.default, _experts_ops("int4"),
                                linear_extra=(group,))  # fmt: skip
    names = sorted(key.removeprefix(prefix) for key, _ in chosen.values())
    return {"int4_weights": len(chosen), "int4_linears": linears, "int4_experts": experts, "int4_names": names}


def _fp32_linear(node: torch.fx.Node, weight: torch.fx.Node) -> bool:
    """node is aten.linear(x, weight, bias?) with fp32 x (and bias): what mtp::linear_fp8 computes."""
    if node.target is not LINEAR or len(node.args) < 2 or node.args[1] is not weight or node.args[0] is weight:
        return False
    x, bias = node.args[0], node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if not isinstance(x, torch.fx.Node) or x.meta["val"].dtype != torch.float32:
        return False
    return bias is None or (isinstance(bias, torch.fx.Node) and bias is not weight
                            and bias.meta["val"].dtype == torch.float32)  # fmt: skip


def _experts_of(node: torch.fx.Node, weight: torch.fx.Node, chosen: Mapping[torch.fx.Node, Any]) -> bool:
    """node is an mtp::moe_experts over fp32 x whose w_gate_up and w_down (weight among them) are both `chosen` (to be
    stored quantized): what mtp::moe_experts_fp8 / _int8 / _int4 compute, and with ep_size or tp_size > 1 their
    exchange forms (plugins/moe_ep.py), over this rank's experts."""
    if node.target is not _EXPERTS or len(node.args) < 7 or node.kwargs:
        return False
    x, _, _, gu, dn = node.args[:5]
    if gu not in chosen or dn not in chosen or weight not in (gu, dn):
        return False
    return isinstance(x, torch.fx.Node) and x is not weight and x.meta["val"].dtype == torch.float32

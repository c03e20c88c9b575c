"""Checkpoint import/export: Hugging Face checkpoint directories <-> the model's canonical weights.

The only place that knows Hugging Face tensor names. A layout is a table of rules (regex on the
checkpoint name -> canonical name); adding DeepSeek-V3 / MiMo / Qwen3-Next means adding a table, not
new code paths. Every canonical parameter must be filled exactly once, every checkpoint tensor must be
used (or explicitly ignored), and shapes must match; errors name the tensor, the expected and found.

Import streams (docs/CHECKPOINTS.md): `plan_weights` maps the tensor index (names, dtypes, shapes from the
safetensors headers, models/checkpoint_files.py) to canonical tensors and every check runs on that plan
before any data is read; `load_model` then reads only the slices one rank keeps (`_rank_windows`), one
tensor at a time, straight into the engine dtype.

Canonical names (models/glm4_moe.py): `embed_tokens`, `layers.{i}.*`, `norm`, `lm_head`, `mtp.{j}.*`
with routed experts fused per layer as `mlp.w_gate_up [E, 2I, H]` (gate rows, then up rows) and
`mlp.w_down [E, H, I]`.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.checkpoint_files import (
    Bounds,
    CanonicalTensor,
    CheckpointError,
    CheckpointIndex,
    Piece,
    bounds_of,
    index_checkpoint,
    materialize,
    read_tensor,
    weight_files,
)
from models.checkpoint_files import read_model_config as read_model_config  # re-exported: callers import it here
from models.checkpoint_hybrid import HYBRID_LAYOUTS, LAYOUT_NOTES, model_class
from models.config import ModelConfig
from models.config_dsa import DSA_MODEL_TYPES, DSA_RULES
from models.fp8 import Fp8Weight, release_window
from models.glm4_moe import Glm4MoeMTPModel
from models.sharding import shard_pieces
from plugins.mapping import Parallel, RankMapping, rank_mapping

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str  # regex over the checkpoint name; {L} is replaced by num_hidden_layers
    target: str  # canonical name template using the regex groups (\1, \2...), "" = ignore the tensor
    expert_part: str = ""  # "gate" | "up" | "down": a per-expert tensor stacked into the fused layout


# A load's leftovers (reference cycles of the readers) go back to the allocator now, before the executor allocates its
# pools, when they can hold real memory; a full collection costs ~0.2 s in a large process (a test worker, a server
# with its frontends), so small models leave theirs to the next automatic one.
COLLECT_AFTER_BYTES = 256 << 20

# GLM-4.5 / DeepSeek-V3 layout: MTP module j stored as model.layers.{L+j}.* (docs/ARCHITECTURE.md §3).
# Rules are tried in order; the first match wins. MTP rules come first (they also match layers.N).
_BLOCK = r"(input_layernorm|post_attention_layernorm|self_attn\.[a-z_]+|mlp\.(?:gate|shared_experts\.[a-z_]+|[a-z]+_proj))"
GLM4_MOE_RULES: tuple[Rule, ...] = (
    Rule(r"model\.layers\.MTP(\d+)\.(enorm|hnorm|eh_proj)\.weight", r"mtp.\1.\2.weight"),
    Rule(r"model\.layers\.MTP(\d+)\.shared_head\.norm\.weight", r"mtp.\1.final_norm.weight"),
    Rule(r"model\.layers\.MTP(\d+)\.(shared_head\.head|embed_tokens)\.weight", ""),  # shared with the main model
    Rule(r"model\.layers\.MTP(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", r"mtp.\1.block.mlp.w_gate_up", "gate"),
    Rule(r"model\.layers\.MTP(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", r"mtp.\1.block.mlp.w_gate_up", "up"),
    Rule(r"model\.layers\.MTP(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", r"mtp.\1.block.mlp.w_down", "down"),
    Rule(r"model\.layers\.MTP(\d+)\." + _BLOCK + r"\.(weight|bias|e_score_correction_bias)", r"mtp.\1.block.\2.\3"),
    Rule(r"model\.embed_tokens\.weight", "embed_tokens.weight"),
    Rule(r"model\.norm\.weight", "norm.weight"),
    Rule(r"lm_head\.weight", "lm_head.weight"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", r"layers.\1.mlp.w_gate_up", "gate"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", r"layers.\1.mlp.w_gate_up", "up"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", r"layers.\1.mlp.w_down", "down"),
    Rule(r"model\.layers\.(\d+)\." + _BLOCK + r"\.(weight|bias|e_score_correction_bias)", r"layers.\1.\2.\3"),
)
# DeepSeek-V3 / GLM-4.7-Flash: the GLM-4.5 names (the MLA projections q_a_proj, q_a_layernorm, q_b_proj or
# q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj are `self_attn.*` of _BLOCK; MTP at layers.{L+j}),
# plus the experts fused per layer (transformers' in-memory `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj
# [E, H, I]`, the canonical layout already) for checkpoints saved that way; released ones are per expert.
_FUSED_EXPERTS: tuple[Rule, ...] = (
    Rule(r"model\.layers\.MTP(\d+)\.mlp\.experts\.gate_up_proj", r"mtp.\1.block.mlp.w_gate_up"),
    Rule(r"model\.layers\.MTP(\d+)\.mlp\.experts\.down_proj", r"mtp.\1.block.mlp.w_down"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", r"layers.\1.mlp.w_gate_up"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", r"layers.\1.mlp.w_down"),
)
MLA_RULES: tuple[Rule, ...] = _FUSED_EXPERTS + GLM4_MOE_RULES
LAYOUTS: dict[str, tuple[Rule, ...]] = {"glm4_moe": GLM4_MOE_RULES, "deepseek_v3": MLA_RULES, "glm4_moe_lite": MLA_RULES}
LAYOUTS.update({k: tuple(Rule(*row) for row in rows) for k, rows in HYBRID_LAYOUTS.items()})  # MiMo, Qwen3-Next
LAYOUTS.update({k: tuple(Rule(*row) for row in DSA_RULES) + MLA_RULES for k in DSA_MODEL_TYPES})  # + the indexers


@dataclass
class Checkpoint:
    """Every tensor of a checkpoint in memory (`read_checkpoint`): tests and tools only, never a build."""

    config: ModelConfig
    hf_config: dict
    tensors: dict[str, torch.Tensor]  # checkpoint names -> tensors (FP8 weights dequantized to float32)
    path: Path
    sources: dict[str, str] = field(default_factory=dict)  # checkpoint name -> the file it was read from


@dataclass
class WeightPlan:
    """Canonical tensors and where each comes from, planned and checked from the index alone."""

    config: ModelConfig  # num_nextn_predict_layers is 0 when the checkpoint has no MTP weights
    tensors: dict[str, CanonicalTensor]
    notes: list[str] = field(default_factory=list)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in self.tensors.items()}


def _mtp_rename(name: str, num_layers: int) -> str:
    """model.layers.{L+j}.x -> model.layers.MTP{j}.x so MTP rules can match without arithmetic in regexes."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m and int(m.group(1)) >= num_layers:
        return f"model.layers.MTP{int(m.group(1)) - num_layers}.{m.group(2)}"
    return name


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read every tensor of a checkpoint into memory (what a build must never do: it streams, `load_model`)."""
    idx = index_checkpoint(path)
    tensors = {n: read_tensor(idx, n) for n in idx.tensors}
    return Checkpoint(idx.config, idx.hf_config, tensors, idx.path, {n: t.file.name for n, t in idx.tensors.items()})


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over config.json and the weight files (recorded in engine configs)."""
    path = Path(path)
    h = hashlib.sha256()
    for file in [path / "config.json", *weight_files(path)]:
        h.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def plan_weights(idx: CheckpointIndex) -> WeightPlan:
    """Map checkpoint tensors to canonical names (experts stacked), from the index: no tensor data is read.

    Drops MTP modules that are absent (with a note)."""
    cfg = idx.config
    rules = LAYOUTS[cfg.model_type]
    out: dict[str, CanonicalTensor] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}
    unmatched = []
    for name, info in idx.tensors.items():
        renamed = _mtp_rename(name, cfg.num_hidden_layers)
        for rule in rules:
            m = re.fullmatch(rule.pattern, renamed)
            if m is None:
                continue
            if rule.target == "":
                break
            target = m.expand(rule.target)
            if rule.expert_part:
                experts.setdefault(target, {}).setdefault(int(m.group(2)), {})[rule.expert_part] = name
            elif target in out:
                raise CheckpointError(f"tensor {target} is given twice (second time as {name}); remove the duplicate")
            else:
                out[target] = CanonicalTensor(info.shape, (Piece(name, (0,) * len(info.shape)),))
            break
        else:
            unmatched.append(name)
    if unmatched:
        raise CheckpointError(
            f"unexpected tensors not in the {cfg.model_type} layout: {sorted(unmatched)[:10]}"
            f"{' ...' if len(unmatched) > 10 else ''}; is model_type right, or is this a different checkpoint?"
        )
    for target, per_expert in experts.items():
        out[target] = _stack_experts(idx, target, per_expert, cfg.n_routed_experts)
    if cfg.tie_word_embeddings and "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    notes = [LAYOUT_NOTES[cfg.model_type]] if cfg.model_type in LAYOUT_NOTES else []
    present_mtp = {int(k.split(".")[1]) for k in out if k.startswith("mtp.")}
    num_mtp = cfg.num_nextn_predict_layers
    if num_mtp and not present_mtp:
        notes.append(
            f"config says num_nextn_predict_layers={num_mtp} but the checkpoint has no MTP weights "
            f"(model.layers.{cfg.num_hidden_layers}.*): MTP speculative decoding is unavailable for this model"
        )
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "num_nextn_predict_layers": 0})
    return WeightPlan(cfg, out, notes)


def rope_row_order(rope_dim: int) -> torch.Tensor:
    """De-interleave permutation of rope rows: pairs (x0, x1), (x2, x3)... -> [x0, x2, ..., x1, x3, ...]."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


_ROPE_ROWS = re.compile(r"(layers\.\d+|mtp\.\d+\.block)\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)\.(weight|bias)")


def deinterleave_rope_rows(cfg: ModelConfig, weights: dict[str, torch.Tensor], inverse: bool = False):
    """MLA with rope_interleave: permute the rope output rows of q_proj / q_b_proj (each head's last
    qk_rope_head_dim rows) and of kv_a_proj_with_mqa (its last qk_rope_head_dim rows, k_pe) once at import.

    DeepSeek ropes interleaved pairs with one frequency each; after this permutation the neox rotate_half rope
    (plugins/rope.py) computes the same values, and q_pe . k_pe is unchanged because q and k are permuted
    alike. `inverse=True` restores the checkpoint order (export). A no-op unless cfg.rope_interleave.
    """
    if not (cfg.is_mla and cfg.rope_interleave):
        return weights
    return {name: deinterleave_rope_tensor(cfg, name, t, inverse) for name, t in weights.items()}


def deinterleave_rope_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """deinterleave_rope_rows for one canonical tensor (streaming imports call this per tensor)."""
    m = _ROPE_ROWS.fullmatch(name)
    if m is None or not (cfg.is_mla and cfg.rope_interleave):
        return t
    order = rope_row_order(cfg.qk_rope_head_dim)
    if inverse:
        order = torch.argsort(order)
    if m.group(2) == "kv_a_proj_with_mqa":
        rows = torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + order])
    else:  # per head [nope rows ; rope rows] (a tensor-parallel rank's slice holds its heads only)
        head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        one = torch.cat([torch.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + order])
        rows = (torch.arange(t.shape[0] // head)[:, None] * head + one[None, :]).reshape(-1)
    if t.shape[0] != rows.shape[0]:
        raise CheckpointError(f"tensor {name}: {t.shape[0]} output rows, config.json implies {rows.shape[0]} "
                              "(qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, num_attention_heads)")  # fmt: skip
    return t.index_select(0, rows)


def _stack_experts(idx: CheckpointIndex, target: str, per_expert: dict[int, dict[str, str]],
                   num_experts: int) -> CanonicalTensor:  # fmt: skip
    missing = [e for e in range(num_experts) if e not in per_expert]
    if missing:
        raise CheckpointError(f"{target}: experts {missing[:8]} are missing from the checkpoint")
    parts = [per_expert[e] for e in range(num_experts)]
    names = ["down"] if target.endswith("w_down") else ["gate", "up"]
    shape = {part: idx.tensors[parts[0][part]].shape for part in names if part in parts[0]}
    for e, p in enumerate(parts):
        for part in names:
            if part not in p:
                raise CheckpointError(f"{target}: expert {e} lacks its {part}_proj tensor")
            if idx.tensors[p[part]].shape != shape[part]:
                raise CheckpointError(
                    f"{target}: expert {e} {part}_proj has shape {idx.tensors[p[part]].shape}, expert 0 has "
                    f"{shape[part]}; every expert of a layer must have the same shape"
                )
    if names == ["down"]:
        return CanonicalTensor((num_experts, *shape["down"]),
                               tuple(Piece(p["down"], (e, 0, 0), stacked=True) for e, p in enumerate(parts)))  # fmt: skip
    gate, up = shape["gate"], shape["up"]
    if len(gate) != 2 or gate[1:] != up[1:]:
        raise CheckpointError(f"{target}: gate_proj {gate} and up_proj {up} do not stack; "
                              "both must be [moe_intermediate_size, hidden_size]")  # fmt: skip
    pieces = [Piece(p[k], (e, off, 0), stacked=True) for e, p in enumerate(parts) for k, off in (("gate", 0),
              ("up", gate[0]))]  # fmt: skip
    return CanonicalTensor((num_experts, gate[0] + up[0], gate[1]), tuple(pieces))


def check_weights(cfg: ModelConfig, shapes: Mapping[str, Sequence[int]], path: str | Path) -> None:
    """Every canonical tensor present once with the shape config.json implies, and nothing else."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_class(cfg)(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensors {missing[:10]}; it does not match config.json")
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {path} has tensors the config does not describe: {extra[:10]}; fix "
                              "config.json (e.g. attention_bias, n_shared_experts) or remove them")  # fmt: skip
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(
                f"tensor {name}: expected shape {shape} from config.json, found {tuple(shapes[name])}; "
                "config.json and the weights disagree: fix config.json or re-export the checkpoint"
            )


def kept_experts(cfg: ModelConfig, ep_rank: int, ep_size: int) -> range:
    """The routed experts EP rank `ep_rank` of `ep_size` holds: expert e lives on rank e // (E / ep_size)."""
    if cfg.has_moe and cfg.n_routed_experts % ep_size:
        raise CheckpointError(f"n_routed_experts={cfg.n_routed_experts} does not split over ep_size={ep_size}")
    n = cfg.n_routed_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def default_mapping(cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1) -> RankMapping:
    """The TP1 expert-parallel mapping of (ep_rank, ep_size); ep_size 1: every rank loads the same shards."""
    kept_experts(cfg, ep_rank, ep_size)  # refuses an expert count that does not split
    rank = ep_rank if ep_size > 1 else 0
    return rank_mapping(rank, Parallel(ep_size, ep_size, 1), cfg.n_routed_experts if cfg.has_moe else 0)


def _rank_windows(cfg: ModelConfig, name: str, full_shape: tuple[int, ...], mapping: RankMapping) -> tuple[Bounds, ...]:
    """The windows of canonical tensor `name` one rank keeps, concatenated along axis 0 (one window for all but a
    Gated DeltaNet layer's [q | k | v] channels): models/sharding.py decides (routed experts by EP range, TP
    rows/columns, vocab slices), the loader only reads those windows."""
    pieces = shard_pieces(name, full_shape, cfg, mapping)
    return tuple(bounds_of(p, full_shape) for p in pieces) if pieces else (bounds_of(None, full_shape),)


def _weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype  # the router bias stays fp32


def rank_weight_bytes(plan: WeightPlan, dtype: torch.dtype, mapping: RankMapping | None = None) -> int:
    """Bytes of the weights one rank holds in `dtype` (the memory check's figure), from the plan alone."""
    mapping = mapping or default_mapping(plan.config)
    total = 0
    for name, ct in plan.tensors.items():
        for bounds in _rank_windows(plan.config, name, ct.shape, mapping):
            numel = 1
            for a, b in bounds:
                numel *= b - a
            total += numel * torch.empty((), dtype=_weight_dtype(name, dtype)).element_size()
    return total


def load_fp8_weights(path: str | Path, mapping: RankMapping | None = None) -> dict[str, Fp8Weight]:
    """The canonical weights a rank keeps that are FP8 in the checkpoint, as released (not dequantized): dense 2-D
    weights and stacks of routed experts, for the compiled engine (builder/compile_aoti.py). Empty for a float
    checkpoint. Windows that split a scale block are left out (models/fp8.py release_window), so stay dequantized;
    load_model's values are the reference, and the compile step checks the two agree."""
    idx = index_checkpoint(path)
    if idx.fp8 is None:
        return {}
    plan = plan_weights(idx)
    cfg, out = plan.config, {}
    mapping = mapping or default_mapping(cfg)
    for name, ct in plan.tensors.items():
        windows = _rank_windows(cfg, name, ct.shape, mapping)
        if len(windows) > 1:  # a GDN layer's [q | k | v] rows: not one window of the release, stays dequantized
            continue
        bounds = windows[0]
        rows = deinterleave_rope_tensor(cfg, name, torch.arange(ct.shape[0])[:, None])[:, 0] if len(ct.shape) == 2 else None
        got = release_window(idx, ct, bounds, rows)
        if got is not None:
            out[name] = got
    return out


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, ep_rank: int = 0, ep_size: int = 1,
    mapping: RankMapping | None = None,
) -> tuple[Glm4MoeMTPModel, CheckpointIndex]:
    """Build one rank's model from a checkpoint directory, reading only the tensors (slices) that rank keeps.

    `mapping` (plugins/mapping.py) gives the rank's TP/EP shards; without it, (ep_rank, ep_size)
    is the TP1 expert-parallel mapping. Every name/shape check runs on the index first; then each tensor is
    read once, converted to `dtype` and its file mapping dropped before the next (peak memory: this rank's
    weights plus about one tensor).
    """
    idx = index_checkpoint(path)
    plan = plan_weights(idx)
    cfg = plan.config
    check_weights(cfg, plan.shapes(), path)
    if mapping is None:
        mapping = default_mapping(cfg, ep_rank, ep_size)
    elif cfg.has_moe and cfg.n_routed_experts % mapping.ep:
        raise CheckpointError(f"n_routed_experts={cfg.n_routed_experts} does not split over ep_size={mapping.ep}")
    with torch.device("meta"):
        model = model_class(cfg)(cfg, mapping=mapping)
    loaded: dict[str, torch.Tensor] = {}
    done: dict[tuple, torch.Tensor] = {}  # (id(CanonicalTensor), window) -> tensor: a tied lm_head is read once
    for name, param in model.state_dict().items():
        ct = plan.tensors[name]
        windows = _rank_windows(cfg, name, ct.shape, mapping)
        w = done.get((id(ct), windows))
        if w is None:
            parts = [materialize(idx, ct, bounds, _weight_dtype(name, dtype)) for bounds in windows]
            w = deinterleave_rope_tensor(cfg, name, parts[0] if len(parts) == 1 else torch.cat(parts))
            done[(id(ct), windows)] = w
        if tuple(w.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {name}: expected shape {tuple(param.shape)} from config.json, found {tuple(w.shape)}"
            )
        loaded[name] = w
    del done
    loaded_bytes = sum(w.nbytes for w in loaded.values())
    model.load_state_dict(loaded, assign=True, strict=True)
    del loaded
    if loaded_bytes >= COLLECT_AFTER_BYTES:
        gc.collect()
    for note in plan.notes:
        log.warning(note)
    return model.eval(), idx

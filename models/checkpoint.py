"""Checkpoint import/export: Hugging Face checkpoint directories <-> the model's canonical weights.

The only place that knows Hugging Face tensor names. A layout is a table of rules (regex on the
checkpoint name -> canonical name); adding DeepSeek-V3 / MiMo / Qwen3-Next means adding a table, not
new code paths. Every canonical parameter must be filled exactly once, every checkpoint tensor must be
used (or explicitly ignored), and shapes must match; errors name the tensor, the expected and found.

Canonical names (models/glm4_moe.py): `embed_tokens`, `layers.{i}.*`, `norm`, `lm_head`, `mtp.{j}.*`
with routed experts fused per layer as `mlp.w_gate_up [E, 2I, H]` (gate rows, then up rows) and
`mlp.w_down [E, H, I]`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ConfigError, ModelConfig
from models.glm4_moe import Glm4MoeMTPModel
from models.safetensors_header import SafetensorsHeaderError, check_safetensors_header
from models.sharding import shard_slice
from plugins.engine_format.config import Parallel
from plugins.engine_format.mapping import RankMapping, rank_mapping

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the problem and the fix."""


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str  # regex over the checkpoint name; {L} is replaced by num_hidden_layers
    target: str  # canonical name template using the regex groups (\1, \2...), "" = ignore the tensor
    expert_part: str = ""  # "gate" | "up" | "down": a per-expert tensor stacked into the fused layout


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
LAYOUTS: dict[str, tuple[Rule, ...]] = {"glm4_moe": GLM4_MOE_RULES}


@dataclass
class Checkpoint:
    config: ModelConfig
    hf_config: dict
    tensors: dict[str, torch.Tensor]  # checkpoint names -> tensors (loaded lazily is not needed at our sizes)
    path: Path
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # checkpoint name -> the file it was read from


def _mtp_rename(name: str, num_layers: int) -> str:
    """model.layers.{L+j}.x -> model.layers.MTP{j}.x so MTP rules can match without arithmetic in regexes."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m and int(m.group(1)) >= num_layers:
        return f"model.layers.MTP{int(m.group(1)) - num_layers}.{m.group(2)}"
    return name


def read_model_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """(validated ModelConfig, raw Hugging Face dict) from config.json alone: no weight file is opened."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"checkpoint {path} is a file, not a directory; pass --checkpoint DIR (the directory "
                              "holding config.json and the safetensors files)")  # fmt: skip
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; pass --checkpoint DIR with config.json")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json; a Hugging Face checkpoint directory needs one")
    try:
        hf = json.loads(cfg_file.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); fix or re-export the checkpoint") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {cfg_file}: {e.strerror}; check its permissions") from e
    try:
        return ModelConfig.from_hf_dict(hf), hf
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read config.json and all safetensors tensors of a checkpoint directory, validating config and headers."""
    path = Path(path)
    config, hf = read_model_config(path)
    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for file in _weight_files(path):
        try:
            check_safetensors_header(file)
        except SafetensorsHeaderError as e:
            raise CheckpointError(str(e)) from e
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[name] = f.get_tensor(name)
                    sources[name] = file.name
        except Exception as e:  # safetensors raises its own error type (and OSError); the header check ran first
            raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {e}); re-download or re-save it") from e
    return Checkpoint(config=config, hf_config=hf, tensors=tensors, path=path, sources=sources)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            raw = json.loads(index.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not valid JSON ({e}); fix it or re-save the checkpoint") from e
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f'{index} has no "weight_map" object (tensor name -> shard file name); fix it or '
                                  "re-save the checkpoint")  # fmt: skip
        root = path.resolve()
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).resolve().is_relative_to(root):
                raise CheckpointError(f"{index} names shard {shard!r} outside the checkpoint directory; shards must "
                                      "sit next to the index")  # fmt: skip
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards named in {index.name} are missing: {missing}; copy them next to it")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json; save with safetensors")


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over config.json and the weight files (recorded in engine configs)."""
    path = Path(path)
    h = hashlib.sha256()
    for file in [path / "config.json", *_weight_files(path)]:
        h.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def to_canonical(ckpt: Checkpoint) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Map checkpoint tensors to canonical names (experts stacked). Drops MTP modules that are absent."""
    cfg = ckpt.config
    rules = LAYOUTS[cfg.model_type]
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    unmatched = []
    for name, tensor in ckpt.tensors.items():
        renamed = _mtp_rename(name, cfg.num_hidden_layers)
        for rule in rules:
            m = re.fullmatch(rule.pattern, renamed)
            if m is None:
                continue
            if rule.target == "":
                break
            target = m.expand(rule.target)
            if rule.expert_part:
                experts.setdefault(target, {}).setdefault(int(m.group(2)), {})[rule.expert_part] = tensor
            elif target in out:
                raise CheckpointError(f"tensor {target} is given twice (second time as {name}); remove the duplicate")
            else:
                out[target] = tensor
            break
        else:
            unmatched.append(name)
    if unmatched:
        raise CheckpointError(
            f"unexpected tensors not in the {cfg.model_type} layout: {sorted(unmatched)[:10]}"
            f"{' ...' if len(unmatched) > 10 else ''}; is model_type right, or is this a different checkpoint?"
        )
    for target, per_expert in experts.items():
        out[target] = _stack_experts(target, per_expert, cfg.n_routed_experts)
    if cfg.tie_word_embeddings and "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    present_mtp = {int(k.split(".")[1]) for k in out if k.startswith("mtp.")}
    num_mtp = cfg.num_nextn_predict_layers
    if num_mtp and not present_mtp:
        ckpt.notes.append(
            f"config says num_nextn_predict_layers={num_mtp} but the checkpoint has no MTP weights "
            f"(model.layers.{cfg.num_hidden_layers}.*): MTP speculative decoding is unavailable for this model"
        )
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "num_nextn_predict_layers": 0})
    return cfg, out


def _stack_experts(target: str, per_expert: dict[int, dict[str, torch.Tensor]], num_experts: int) -> torch.Tensor:
    missing = [e for e in range(num_experts) if e not in per_expert]
    if missing:
        raise CheckpointError(f"{target}: experts {missing[:8]} are missing from the checkpoint")
    parts = [per_expert[e] for e in range(num_experts)]
    names = ["down"] if target.endswith("w_down") else ["gate", "up"]
    for e, p in enumerate(parts):
        for part in names:
            if part not in p:
                raise CheckpointError(f"{target}: expert {e} lacks its {part}_proj tensor")
            if p[part].shape != parts[0][part].shape:
                raise CheckpointError(
                    f"{target}: expert {e} {part}_proj has shape {tuple(p[part].shape)}, expert 0 has "
                    f"{tuple(parts[0][part].shape)}; every expert of a layer must have the same shape"
                )
    if names == ["down"]:
        return torch.stack([p["down"] for p in parts])
    gate, up = parts[0]["gate"], parts[0]["up"]
    if gate.dim() != 2 or gate.shape[1:] != up.shape[1:]:
        raise CheckpointError(f"{target}: gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} do not stack; "
                              "both must be [moe_intermediate_size, hidden_size]")  # fmt: skip
    return torch.stack([torch.cat([p["gate"], p["up"]], dim=0) for p in parts])


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Every canonical tensor present once with the shape config.json implies, and nothing else."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Glm4MoeMTPModel(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensors {missing[:10]}; it does not match config.json")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {path} has tensors the config does not describe: {extra[:10]}; fix "
                              "config.json (e.g. attention_bias, n_shared_experts) or remove them")  # fmt: skip
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(
                f"tensor {name}: expected shape {shape} from config.json, found {tuple(weights[name].shape)}; "
                "config.json and the weights disagree: fix config.json or re-export the checkpoint"
            )


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, ep_rank: int = 0, ep_size: int = 1,
    mapping: RankMapping | None = None,
) -> tuple[Glm4MoeMTPModel, Checkpoint]:
    """Build the model from a checkpoint directory, sliced to this rank's shards (models/sharding.py).

    `mapping` (plugins/engine_format/mapping.py) gives the rank's TP/EP slices; without it, (ep_rank, ep_size)
    is the TP1 expert-parallel mapping of today.
    """
    ckpt = read_checkpoint(path)
    cfg, weights = to_canonical(ckpt)
    if cfg.has_moe and cfg.n_routed_experts % (mapping.ep if mapping else ep_size):
        raise CheckpointError(f"n_routed_experts={cfg.n_routed_experts} does not split over ep_size={ep_size}")
    check_weights(cfg, weights, path)
    if mapping is None:
        rank = ep_rank if ep_size > 1 else 0  # replicated experts: every rank loads the same (rank-0) shards
        mapping = rank_mapping(rank, Parallel(ep_size, ep_size, 1), cfg.n_routed_experts if cfg.has_moe else 0)
    with torch.device("meta"):
        model = Glm4MoeMTPModel(cfg, mapping=mapping)
    expected = dict(model.state_dict())
    loaded = {}
    for name, param in expected.items():
        w = weights[name]
        shard = shard_slice(name, tuple(w.shape), cfg, mapping)
        if shard is not None:
            w = w[shard].contiguous()
        if tuple(w.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {name}: expected shape {tuple(param.shape)} from config.json, found {tuple(w.shape)}"
            )
        loaded[name] = w.to(dtype) if name.split(".")[-1] != "e_score_correction_bias" else w.float()
    model.load_state_dict(loaded, assign=True, strict=True)
    for note in ckpt.notes:
        log.warning(note)
    return model.eval(), ckpt


def to_hf_tensors(model: Glm4MoeMTPModel) -> dict[str, torch.Tensor]:
    """Canonical weights -> Hugging Face checkpoint names (inverse of GLM4_MOE_RULES; MTP shares head)."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        m = re.match(r"(layers\.(\d+)|mtp\.(\d+)\.block)\.mlp\.(w_gate_up|w_down)$", name)
        prefix = _hf_prefix(name, cfg.num_hidden_layers)
        if m:
            for e in range(t.shape[0]):
                if m.group(4) == "w_down":
                    out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                    out[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif name == "lm_head.weight":
            out[name] = t.clone()
        elif name.startswith("mtp."):
            rest = name.split(".", 2)[2]
            rest = rest.replace("block.", "", 1).replace("final_norm", "shared_head.norm")
            out[f"{prefix}.{rest}"] = t.clone()
        else:
            out[f"model.{name}"] = t.clone()
    return out


def _hf_prefix(name: str, num_layers: int) -> str:
    m = re.match(r"layers\.(\d+)", name)
    if m:
        return f"model.layers.{m.group(1)}"
    m = re.match(r"mtp\.(\d+)", name)
    if m:
        return f"model.layers.{num_layers + int(m.group(1))}"
    return "model"


def save_hf_checkpoint(model: Glm4MoeMTPModel, hf_config: dict, path: str | Path) -> None:
    """Write config.json + model.safetensors in the Hugging Face Glm4Moe layout (loadable by transformers)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_tensors(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def to_hf_config(cfg: ModelConfig) -> dict:
    """A Hugging Face Glm4MoeConfig dict for `cfg` (what save_hf_checkpoint writes as config.json)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        "attention_bias": cfg.attention_bias,
        "use_qk_norm": cfg.use_qk_norm,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_shared_experts": cfg.n_shared_experts,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": list(cfg.eos_token_id) or None,
        "dtype": "float32",
    }

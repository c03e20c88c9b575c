"""The realistic-size format bench's pure parts: which formats run against which llama.cpp quant, the weight bytes a
decode token reads in each format (its bandwidth bound), the per-format summary and the depth projection.

Nothing here runs or times a model (runtime/bench/realsize_formats.py does; tests/runtime/test_realsize_bench.py
checks this arithmetic).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from models.config import ModelConfig
from runtime.bench.bound import expected_experts

AIR_DEPTH = 46  # GLM-4.5-Air's main layers (zai-org/GLM-4.5-Air config.json); the bench's checkpoint has 2
WEIGHT_KINDS = ("attention", "dense_mlp", "router", "routed_experts", "lm_head", "other")


@dataclass(frozen=True)
class Format:
    """One weight format of ours and the llama.cpp quant of the same weights it is compared with.

    bytes_per_weight: bytes the engine reads per weight of each kind (WEIGHT_KINDS), scales included; what
    `mtp-build` stores (docs/PERFORMANCE.md): the embedding row, norms and biases ("other") stay as the checkpoint
    has them, the LM head and the router stay bf16 in every format (no --quantize-lm-head)."""

    name: str
    checkpoint: str  # relative to the bench's build dir: air2 (bf16) or air2-fp8
    engine: str  # engine directory name in the build dir
    build_flags: tuple[str, ...]  # mtp-build flags beyond the common ones
    llama_quant: str  # llama-quantize type name (BF16: the converter's own output)
    label: str  # what the engine stores, said plainly (the table's row label)
    bytes_per_weight: dict[str, float]


def _bpw(attention: float, dense: float, routed: float) -> dict[str, float]:
    return {"attention": attention, "dense_mlp": dense, "router": 2.0, "routed_experts": routed, "lm_head": 2.0,
            "other": 2.0}  # fmt: skip


FP8_BLOCK_SCALE = 4 / (128 * 128)  # one fp32 scale per 128x128 block
INT8_ROW_SCALE = 4 / 4096  # one fp32 scale per output row of a 4096-wide input (the widest share of the bytes)
INT4_GROUP = 0.5 + 4 / 64  # 4 bits + one fp32 scale per 64 inputs (the builder's default group; Q4_0's bytes)
FORMATS = (
    Format("bf16", "air2", "engine", (), "BF16", "bf16 weights (mtp::linear_bf16, fp32 math)",
           _bpw(2.0, 2.0, 2.0)),
    Format("fp8", "air2-fp8", "engine-fp8", (), "Q8_0",
           "FP8 e4m3 checkpoint kept native (128x128 block scales)", _bpw(*[1.0 + FP8_BLOCK_SCALE] * 3)),
    Format("int8", "air2", "engine-int8", ("--quantize", "int8"), "Q8_0",
           "--quantize int8 (per-channel, weight-only; experts int8)", _bpw(*[1.0 + INT8_ROW_SCALE] * 3)),
    Format("int4", "air2", "engine-int4", ("--quantize", "int4"), "Q4_0",
           "--quantize int4 (group 64: dense linears and routed experts, mtp::linear_int4 / moe_experts_int4)",
           _bpw(INT4_GROUP, INT4_GROUP, INT4_GROUP)),
)  # fmt: skip
LLAMA_QUANTS = ("BF16", "Q8_0", "Q4_0", "Q4_K_M")
COMMON_BUILD_FLAGS = ("--compile", "aoti", "--max-batch", "1", "--max-num-tokens", "64", "--max-seq-len", "256",
                      "--num-draft-tokens", "3", "--force")  # fmt: skip


def format_by_name(name: str) -> Format:
    for f in FORMATS:
        if f.name == name:
            return f
    raise ValueError(f"unknown format {name!r}: choose from {', '.join(f.name for f in FORMATS)}")


def main_params_by_kind(c: ModelConfig, tokens: int) -> dict[str, float]:
    """Parameters one main forward over `tokens` tokens reads, by kind; they add up to bound.forward_params(c,
    tokens).main (routed experts: the expected distinct experts under uniform top-k routing)."""
    h = c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    expert = 3 * h * c.moe_intermediate_size
    out = dict.fromkeys(WEIGHT_KINDS, 0.0)
    for layer in range(c.num_hidden_layers):
        out["attention"] += h * (q + 2 * kv) + q * h
        out["other"] += 2 * h + ((q + 2 * kv) if c.attention_bias else 0) + (2 * c.head_dim if c.use_qk_norm else 0)
        if c.is_moe_layer(layer):
            out["router"] += h * c.n_routed_experts + c.n_routed_experts
            out["dense_mlp"] += c.n_shared_experts * expert
            out["routed_experts"] += expected_experts(c, tokens) * expert
        else:
            out["dense_mlp"] += 3 * h * c.intermediate_size
    out["lm_head"] = float(c.vocab_size * h)
    out["other"] += h + tokens * h  # final norm + one embedding row per token
    return out


def main_bytes(c: ModelConfig, tokens: int, fmt: Format) -> float:
    """Weight bytes one main forward over `tokens` tokens reads in format `fmt`."""
    return sum(n * fmt.bytes_per_weight[k] for k, n in main_params_by_kind(c, tokens).items())


def at_depth(c: ModelConfig, depth: int) -> ModelConfig:
    """The same layer shapes with `depth` main layers (the first first_k_dense_replace dense, the rest MoE)."""
    return dataclasses.replace(c, num_hidden_layers=depth)


def project_depth(ms: dict[str, float], c: ModelConfig, fmt: Format, accept: dict[int, float],
                  depth: int = AIR_DEPTH) -> dict[str, dict]:  # fmt: skip
    """MTP speed-up PROJECTED to `depth` main layers of the bench's layer shapes: each measured main forward
    (decode, verify at 1+K rows) scaled by the weight bytes it reads at that depth over the bytes at the bench's
    depth (decode at this size is bound by weight reads, so time follows bytes); the draft and the commit pass are
    taken as measured (one MTP layer at either depth). x_k0 = acceptance * decode / (verify + K * draft + commit)."""
    deep = at_depth(c, depth)

    def scaled(key: str, tokens: int) -> float:
        return ms[key] * main_bytes(deep, tokens, fmt) / main_bytes(c, tokens, fmt)

    decode = scaled("decode", 1)
    out: dict[str, dict] = {"0": {"step_ms": round(decode, 3), "x_k0": 1.0}}
    for k, acc in sorted(accept.items()):
        if f"verify_{1 + k}" not in ms or "draft" not in ms or f"commit_{1 + k}" not in ms:
            continue
        step = scaled(f"verify_{1 + k}", 1 + k) + k * ms["draft"] + ms[f"commit_{1 + k}"]
        out[str(k)] = {"step_ms": round(step, 3), "tokens_per_step": acc, "x_k0": round(acc * decode / step, 3)}
    return out


def mtp_at_bench_depth(ms: dict[str, float], accept: dict[int, float]) -> dict[str, float]:
    """x K=0 at the bench's own depth from the measured step costs (also a projection: the acceptance is the deep
    model's, random weights accept nothing real)."""
    out = {}
    for k, acc in sorted(accept.items()):
        if all(key in ms for key in (f"verify_{1 + k}", "draft", f"commit_{1 + k}")):
            step = ms[f"verify_{1 + k}"] + k * ms["draft"] + ms[f"commit_{1 + k}"]
            out[str(k)] = round(acc * ms["decode"] / step, 3)
    return out


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per-key median over rounds (a key missing from a round is left out of that key's median)."""
    keys = {k for r in rounds for k in r}
    return {k: round(statistics.median([r[k] for r in rounds if k in r]), 3) for k in sorted(keys)}


def gguf_bytes_per_token(tensors: list[tuple[str, int, int]], main_layers: int, top_k: int, n_experts: int,
                         hidden: int) -> float:  # fmt: skip
    """Bytes llama.cpp reads for one main decode token, from the GGUF's tensors as (name, n_elements, n_bytes):
    every tensor of blocks below `main_layers` (the MTP block `blk.{main_layers}` is not run at K=0), the merged
    expert tensors (`*_exps`) at top_k / n_experts of their bytes, `output` whole, one `hidden`-wide row of
    `token_embd`."""
    total = 0.0
    for name, n_el, n_bytes in tensors:
        m = re.match(r"blk\.(\d+)\.", name)
        if m is not None:
            if int(m.group(1)) < main_layers:
                total += n_bytes * (top_k / n_experts if "_exps." in name else 1.0)
        elif name.startswith("token_embd"):
            total += n_bytes * hidden / n_el
        else:
            total += n_bytes
    return total


def dir_bytes(path: Path, pattern: str = "*") -> int:
    """Bytes on disk of a file, or of the files under a directory whose names match `pattern` (an engine's size)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


def compiled_bytes(engine: Path) -> int:
    """What the compiled executor loads: the packages (`*.aoti*.pt2`, the fused draft's too) and each rank's weight
    store (`rankN/weights.safetensors`, where the packages' weights live), without the ONNX graphs beside them."""
    return dir_bytes(engine, "*.aoti*.pt2") + dir_bytes(engine, "weights.safetensors")

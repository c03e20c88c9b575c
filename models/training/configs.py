"""The shipped models' architectures and training recipes: `tiny` (3 layers, fast tests) and `deep`
(12 layers, the demo / bench model). One preset per model; `python -m models.training.train --model NAME`
picks one, so `make tiny-model` and `make deep-model` differ only in that flag and the output directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.config import ModelConfig


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 900
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2.5e-3
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"  # or "wsd" (warm-up, stable, decay): see train.lr_at
    decay_fraction: float = 0.2  # wsd: the last 20% of the steps decay linearly
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # One weight per MTP training depth: depth j (chained as the draft loop chains, models/training/chained.py)
    # predicts t_{p+j+1}. (0.3,) is DeepSeek-V3's depth-1 objective (0.3 for its first 10T tokens).
    mtp_lambdas: tuple[float, ...] = (0.3,)
    bias_update_speed: float = 1e-3  # DeepSeek-V3's gamma for the aux-loss-free balancing
    vocab_size: int = 2048
    eval_tokens: int = 65_536  # held-out tokens scored at the end (evenly spaced windows over all held-out files)
    eval_depths: int = 3  # chained draft depths measured on the held-out split (acceptance 1..eval_depths)
    threads: int = 2
    ship_dtype: str = "float32"  # "bfloat16": matrices stored in bf16 (1-D tensors stay fp32)

    @property
    def mtp_depths(self) -> int:
        return len(self.mtp_lambdas)


@dataclass(frozen=True)
class Preset:
    name: str
    settings: TrainSettings
    arch: dict = field(default_factory=dict)  # ModelConfig fields beyond the shared GLM-4.5 defaults below

    def model_config(self, vocab_size: int, eos_id: int) -> ModelConfig:
        cfg = ModelConfig(**{**_GLM_DEFAULTS, **self.arch, "vocab_size": vocab_size, "eos_token_id": (eos_id,)})
        cfg.validate()
        return cfg


# GLM-4.5 family traits both models share: GQA (4 query heads per KV head), head dim 32, partial RoPE 0.5, layer 0
# dense then MoE with 8 routed experts, top-2 grouped sigmoid routing (1 of 2 groups) and a shared expert, one MTP.
_GLM_DEFAULTS: dict = dict(
    model_type="glm4_moe",
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.5,
    rope_theta=10000.0,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    n_shared_experts=1,
    num_nextn_predict_layers=1,
    max_position_embeddings=1024,
)

PRESETS: dict[str, Preset] = {
    # ~3.6M parameters (~14 MB fp32): trained on 2 cores in ~14 minutes (docs/TINY_MODEL.md).
    "tiny": Preset(
        "tiny",
        TrainSettings(),
        dict(intermediate_size=512, num_hidden_layers=3, moe_intermediate_size=64),
    ),
    # ~12.1M parameters (~24 MB as bf16): 12 layers, so one MTP draft depth (1 block + eh_proj + the shared head)
    # is a small fraction of a main forward; trained on ONE core (a shared machine) with the chained 3-depth MTP
    # loss, so drafts at depths 2-3 are trained on exactly the inputs the runtime's draft loop gives them.
    "deep": Preset(
        "deep",
        TrainSettings(
            steps=800,
            lr=2e-3,
            warmup_steps=40,
            schedule="wsd",
            mtp_lambdas=(0.3, 0.3, 0.3),
            threads=1,
            ship_dtype="bfloat16",
        ),
        dict(intermediate_size=1024, num_hidden_layers=12, moe_intermediate_size=96),
    ),
}


def tiny_model_config(vocab_size: int, eos_id: int) -> ModelConfig:
    return PRESETS["tiny"].model_config(vocab_size, eos_id)


def per_token_macs(cfg: ModelConfig, context: int) -> tuple[int, int]:
    """Multiply-accumulates per decoded token at `context` tokens of history: (main forward incl. lm_head,
    one MTP draft depth incl. eh_proj and the shared lm_head). Counts matmuls and attention only (norms, RoPE
    and routing are noise at these sizes); MoE counts the ACTIVE experts (top-k + shared)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = (
        h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 2 * context * cfg.num_attention_heads * d
    )
    dense = attn + 3 * h * cfg.intermediate_size
    moe = attn + 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    moe += h * cfg.n_routed_experts  # router
    head = h * cfg.vocab_size
    main = sum(moe if cfg.is_moe_layer(i) else dense for i in range(cfg.num_hidden_layers)) + head
    draft = 2 * h * h + (moe if cfg.has_moe else dense) + head
    return main, draft

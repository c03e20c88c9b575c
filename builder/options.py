"""Build options (`mtp-build` flags) and their validation against each other and the model.

Owns `BuildOptions`, `BuildError` and every "this combination cannot work" message of the builder.
Checks that need the model config (draft modules, experts, positions) are in `validate_for_model`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from models.config import ModelConfig, kv_geometry_fields, num_kv_planes
from models.engine_format.config import Limits
from models.engine_format.layout import KVLayout, StateLayout
from plugins.kv_pool import DTYPE_CODES
from plugins.mapping import MappingError, check_model, check_parallel, local_kv_heads

BACKENDS = ("onnxruntime", "tensorrt")
# --compile: "aoti" adds AOTInductor packages per graph (builder/compile_aoti.py), the fastest CPU executor; "auto"
# (the default) is "aoti" wherever the packages can be built (`resolve_compile`), "none" writes the ONNX graphs only.
COMPILES = ("auto", "none", "aoti")
# --quantize: "int8" stores the compiled engine's dense linears and routed experts as weight-only int8
# (builder/quantized_weights.py int8_weights, mtp::linear_int8, mtp::moe_experts_int8); "none" keeps the checkpoint's
# weights. "int4" stores the dense linears and single-rank routed experts whose input widths are multiples of the group
# (--int4-group-size) as group-wise int4 (int4_weights, mtp::linear_int4, mtp::moe_experts_int4) and the rest int8
# takes as int8.
QUANTIZES = ("none", "int8", "int4")
# --quantize-mtp: "same" (default) quantizes the MTP module's graphs (mtp_draft, mtp_commit) as --quantize does the
# trunk's; "none" keeps them in the checkpoint's precision (peers lose acceptance by quantizing the MTP head).
QUANTIZE_MTPS = ("same", "none")
# --int4-group-size's default, by measurement (docs/PERFORMANCE.md "int4 weights"): against 32, 64 cut mtp::linear_int4's
# time by 19% (AVX-512) / 17% (AVX2) at one row and 38% / 6% at four (4096 x 4096, 1 thread) for +0.06% perplexity on
# models/deep (128: another 5-9% faster, +0.5% perplexity). 64 with fp32 scales is Q4_0's 0.5625 bytes per weight.
INT4_GROUP_DEFAULT = 64
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_ep_size(tp_size: int) -> int:
    """--ep-size when not given: with tp > 1 the only valid values are tp-size and world-size, and the TP group's is
    the default; else 1. The one rule mtp-build and `build_engine` follow."""
    return tp_size if tp_size > 1 else 1


class BuildError(ValueError):
    """A build that cannot proceed; the message names the problem and the fix."""


@dataclass(frozen=True, slots=True)
class BuildOptions:
    checkpoint: Path
    output: Path
    backend: str = "onnxruntime"
    dtype: str = "float32"
    max_batch: int = 8
    max_num_tokens: int = 256
    max_seq_len: int = 512
    kv_block_size: int = 16
    num_draft_tokens: int = 2
    world_size: int = 1
    ep_size: int = 1
    tp_size: int = 1
    force: bool = False
    compile: str = "auto"
    quantize: str = "none"
    quantize_mtp: str = "same"
    quantize_lm_head: bool = False
    int4_group_size: int = INT4_GROUP_DEFAULT
    # --keep-onnx: a compiled engine keeps its ONNX graphs' fp32 weights (`.onnx.data`) and ORT-optimized copies, so
    # that `--executor onnxruntime` (and `auto` where the packages cannot run) can run it too. Without it the compiled
    # engine carries the graph protos (what `mtp-build --check` cross-checks) and the packages' weights only: the fp32
    # ONNX weights were 2-6x the packages' bytes (an FP8 release's 0.94 GB packages beside 3.6 GB of them).
    keep_onnx: bool = False

    def graph_quantize(self, graph: str) -> str:
        """What --quantize means for graph `graph`: the trunk's always; the MTP module's unless --quantize-mtp none."""
        return self.quantize if graph == "main" or self.quantize_mtp == "same" else "none"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def limits(self) -> Limits:
        return Limits(self.max_batch, self.max_num_tokens, self.max_seq_len)

    def kv_layout(self, cfg: ModelConfig) -> KVLayout:
        """The engine's KV layout (models/engine_format/layout.py computes the table width, lookahead included)."""
        kv_heads, head_dim, kv_kind = kv_geometry_fields(cfg)  # MLA: one latent row per position
        return KVLayout.plan(
            num_planes=num_kv_planes(cfg),  # a hybrid model's Gated DeltaNet layers have no KV
            num_kv_heads=local_kv_heads(kv_heads, self.tp_size),  # each rank's pool: its KV heads (MLA: tp 1)
            head_dim=head_dim, dtype_code=DTYPE_CODES[self.torch_dtype], block_size=self.kv_block_size,
            max_batch=self.max_batch, max_seq_len=self.max_seq_len, num_draft_tokens=self.num_draft_tokens,
            kv_kind=kv_kind,
        )  # fmt: skip

    def state_layout(self, cfg: ModelConfig) -> StateLayout | None:
        """The engine's Gated DeltaNet state pool (hybrid models only): K + 2 slots per request."""
        if not cfg.is_hybrid:
            return None
        from models.gdn import state_geometry

        geom = state_geometry(cfg, 0, self.torch_dtype, self.tp_size)  # each rank's pool: its GDN heads
        return StateLayout.plan(geom, self.max_batch, self.num_draft_tokens)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["checkpoint"], d["output"] = str(self.checkpoint), str(self.output)
        return d

    def validate(self) -> None:
        """Checks that need nothing but the flags (run before any file is read)."""
        if self.backend not in BACKENDS:
            raise BuildError(f"--backend {self.backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise BuildError(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        for flag, value in [("--max-batch", self.max_batch), ("--max-num-tokens", self.max_num_tokens),
                            ("--max-seq-len", self.max_seq_len), ("--kv-block-size", self.kv_block_size),
                            ("--world-size", self.world_size), ("--ep-size", self.ep_size),
                            ("--tp-size", self.tp_size)]:  # fmt: skip
            if value < 1:
                raise BuildError(f"{flag} must be >= 1, got {value}")
        if self.num_draft_tokens < 0:
            raise BuildError(f"--num-draft-tokens must be >= 0, got {self.num_draft_tokens}")
        try:  # the mapping contract (docs/ARCHITECTURE.md §8): W % TP, EP in {1, W} (TP 1) or {TP, W}
            check_parallel(self.world_size, self.ep_size, self.tp_size, flags=True)
        except MappingError as e:
            raise BuildError(str(e)) from None
        step_rows = self.max_batch * (1 + self.num_draft_tokens)
        if self.max_num_tokens < step_rows:
            raise BuildError(
                f"--max-num-tokens {self.max_num_tokens} is smaller than max_batch*(1+K) = {self.max_batch}*"
                f"(1+{self.num_draft_tokens}) = {step_rows}: a full batch of decode requests could not verify its "
                f"drafts in one step; raise --max-num-tokens to at least {step_rows} or lower --max-batch"
            )
        if self.num_draft_tokens >= self.kv_block_size:
            raise BuildError(
                f"--num-draft-tokens {self.num_draft_tokens} must be smaller than --kv-block-size "
                f"{self.kv_block_size}: one step's drafts must fit in the block after the base token; "
                "lower K or raise the block size"
            )
        if self.max_seq_len < self.num_draft_tokens + 2:
            raise BuildError(f"--max-seq-len {self.max_seq_len} leaves no room for K={self.num_draft_tokens} drafts")
        if self.compile not in COMPILES:
            raise BuildError(f"--compile {self.compile!r} is unknown; choose one of {', '.join(COMPILES)}")
        if self.compile == "aoti" and self.backend != "onnxruntime":
            raise BuildError(f"--compile {self.compile} builds CPU packages (one set per rank): use it with --backend "
                             f"onnxruntime (got --backend {self.backend}), or drop --compile")  # fmt: skip
        if self.quantize not in QUANTIZES:
            raise BuildError(f"--quantize {self.quantize!r} is unknown; choose one of {', '.join(QUANTIZES)}")
        if self.quantize_mtp not in QUANTIZE_MTPS:
            raise BuildError(f"--quantize-mtp {self.quantize_mtp!r} is unknown; choose one of "
                             f"{', '.join(QUANTIZE_MTPS)}")  # fmt: skip
        if self.quantize_mtp != "same" and self.quantize == "none":
            raise BuildError(f"--quantize-mtp {self.quantize_mtp} only matters with --quantize int8 or int4 (nothing is "
                             "quantized without it); drop --quantize-mtp or add --quantize")  # fmt: skip
        if self.int4_group_size != INT4_GROUP_DEFAULT and self.quantize != "int4":
            raise BuildError(f"--int4-group-size {self.int4_group_size} only applies to --quantize int4 (got --quantize "
                             f"{self.quantize}); add --quantize int4 or drop --int4-group-size")  # fmt: skip
        if self.int4_group_size <= 0 or self.int4_group_size % 2:
            raise BuildError(f"--int4-group-size {self.int4_group_size}: must be a positive even number (a group ends "
                             "on a byte); e.g. 32, 64 (default) or 128")  # fmt: skip
        if self.quantize_lm_head and self.quantize == "none":
            raise BuildError("--quantize-lm-head stores the LM head int8 beside --quantize int8 or int4, which is not "
                             "given; add --quantize int8 or drop --quantize-lm-head")  # fmt: skip
        if self.quantize != "none" and self.compile == "none":
            raise BuildError(f"--quantize {self.quantize} with --compile none is not supported yet: only the compiled "
                             "(aoti) engine reads int8 weights; drop --compile none")  # fmt: skip
        if self.backend == "onnxruntime" and self.dtype != "float32":
            raise BuildError(
                f"--backend onnxruntime supports --dtype float32 only (its plugin ops are onnxruntime-extensions "
                f"Python ops with one fixed element type); use --dtype float32, or --backend tensorrt for {self.dtype}"
            )

    def _validate_hybrid(self, cfg: ModelConfig) -> None:
        """What a hybrid (Gated DeltaNet) engine can be: ONNX Runtime and its AOTInductor packages."""
        what = f"{cfg.model_type} is a hybrid (Gated DeltaNet) model"
        if self.backend == "tensorrt":
            raise BuildError(f"{what}: its GdnStep TensorRT plugin is written and type-checked but has never been built "
                             "or run (no GPU here); build it with --backend onnxruntime")  # fmt: skip

    def _validate_mimo_v2(self) -> None:
        """What a MiMo-V2-Flash engine can be: single-TP-rank ONNX Runtime and its AOTInductor packages (one draft
        graph per MTP module: models/engine_format/graph_io.py draft_graphs)."""
        if self.backend == "tensorrt":
            raise BuildError("mimo_v2_flash: its sliding-window attention's TensorRT plugin (SwaPagedAttention) is "
                             "written and type-checked but has never been built or run on a GPU; build it with "
                             "--backend onnxruntime")  # fmt: skip
        if self.tp_size > 1:
            raise BuildError(f"--tp-size {self.tp_size}: mimo_v2_flash's attention is not split over a TP group yet "
                             "(models/mimo_v2.py); use --tp-size 1")  # fmt: skip

    def resolve_compile(self, cfg: ModelConfig) -> tuple[str, str]:
        """What `--compile` means for this model: ("aoti" | "none", why). "auto" compiles wherever the packages
        can be built: CPU engines (--backend onnxruntime) of every model. The one rule `mtp-build` and `build_engine`
        follow."""
        if self.compile != "auto":
            return self.compile, f"--compile {self.compile}"
        if self.backend != "onnxruntime":
            return "none", f"--backend {self.backend} builds its own plans: no CPU packages"
        return "aoti", "the fastest CPU executor; --compile none skips it"

    def onnx_weights(self, cfg: ModelConfig) -> bool:
        """Whether the engine keeps its ONNX graphs' weights: always where the ONNX graphs are what runs (no compiled
        packages), with the packages only when --keep-onnx asks."""
        return self.keep_onnx or self.resolve_compile(cfg)[0] != "aoti"

    def validate_for_model(self, cfg: ModelConfig, fp8_checkpoint: bool = False) -> None:
        """Checks against the checkpoint's architecture (fp8_checkpoint: config.json declares FP8 weights)."""
        if self.keep_onnx and self.resolve_compile(cfg)[0] != "aoti":
            raise BuildError(f"--keep-onnx keeps the ONNX weights beside the compiled packages, and this build has none "
                             f"({self.resolve_compile(cfg)[1]}): its ONNX graphs keep their weights anyway; drop "
                             "--keep-onnx")  # fmt: skip
        if cfg.model_type == "mimo_v2_flash":
            self._validate_mimo_v2()
        if cfg.is_hybrid:
            self._validate_hybrid(cfg)
        if cfg.is_dsa and self.tp_size > 1:  # the indexer's keys and top-k are not split over a TP group yet
            raise BuildError(f"--tp-size {self.tp_size}: {cfg.model_type} uses DeepSeek Sparse Attention, whose engines "
                             "run on one rank per TP group only (expert parallelism is fine); build with --tp-size 1")  # fmt: skip
        if cfg.is_dsa and self.backend == "tensorrt":  # plugins/_trt_impl.py: the DSA plugins are type-checked only
            raise BuildError(f"--backend tensorrt: {cfg.model_type} uses DeepSeek Sparse Attention, whose TensorRT "
                             "plugins (DsaIndexTopk, DsaSparseAttention) are written and type-checked but have never "
                             "been built or run on a GPU; build with --backend onnxruntime")  # fmt: skip
        if self.quantize != "none":
            if fp8_checkpoint:
                raise BuildError(f"--quantize {self.quantize} with an FP8 checkpoint is not supported yet: its compiled "
                                 "engine already reads the FP8 weights as released (1 byte each); drop --quantize")  # fmt: skip
            compile_, why = self.resolve_compile(cfg)
            if compile_ != "aoti":
                raise BuildError(f"--quantize {self.quantize} without the compiled engine is not supported yet ({why}); "
                                 "drop --quantize")  # fmt: skip
        if self.num_draft_tokens > 0 and cfg.num_mtp_modules == 0:
            raise BuildError(
                "the checkpoint has no MTP module (num_nextn_predict_layers=0) so it cannot draft; "
                "build with --num-draft-tokens 0 or use a checkpoint that ships its MTP layers"
            )
        if self.ep_size > 1 and not cfg.has_moe:
            raise BuildError(f"--ep-size {self.ep_size} needs a MoE model; this checkpoint has no routed experts")
        if self.tp_size > 1 and self.backend == "tensorrt":
            raise BuildError(
                f"--tp-size {self.tp_size} --backend tensorrt: the NCCL collective plugins (plugins/trt_collectives.py) "
                "are written but never run here; build TP engines with --backend onnxruntime"
            )
        inter = [cfg.intermediate_size] if cfg.first_k_dense_replace or not cfg.has_moe else []
        if cfg.has_moe and cfg.n_shared_experts:
            inter.append(cfg.moe_intermediate_size * cfg.n_shared_experts)
        if cfg.shared_expert_intermediate_size:  # Qwen3-Next's one sigmoid-gated shared expert
            inter.append(cfg.shared_expert_intermediate_size)
        try:
            check_model(self.world_size, self.ep_size, self.tp_size, flags=True,
                        num_experts=cfg.n_routed_experts if cfg.has_moe else 0, num_heads=cfg.num_attention_heads,
                        num_kv_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size, mla=cfg.is_mla,
                        inter_sizes=tuple(inter),
                        gdn_key_heads=cfg.linear_num_key_heads if cfg.is_hybrid else 0)  # fmt: skip
        except MappingError as e:
            raise BuildError(str(e)) from None
        if self.max_seq_len > cfg.max_position_embeddings:
            raise BuildError(
                f"--max-seq-len {self.max_seq_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}; lower --max-seq-len"
            )

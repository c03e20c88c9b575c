"""Create an LLMEngine from an engine directory (onnxruntime / tensorrt / torch executor) or a checkpoint.

The one place that wires executors, configs and the tokenizer together; the CLIs, the Triton backend
and the benchmarks all call `create_engine`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from models.engine_format import EngineConfig, KVLayout, Limits, load_engine_config
from models.engine_format.compiled import compiled_problem
from plugins.mapping import MappingError, Parallel, check_model, rank_mapping
from plugins.threads import default_threads, set_threads
from runtime.core.config import DEFAULT_DRAFT_TOKENS, ConfigError, RuntimeConfig
from runtime.core.draft_length import DraftLengthController
from runtime.core.engine import LLMEngine
from runtime.core.verify_lengths import VerifyLengthPolicy
from runtime.executors.base import Executor
from runtime.multirank.strategies import rank_strategy
from runtime.multirank.watchdog import DEFAULT_TIMEOUT_S

EXECUTORS = ("auto", "compiled", "onnxruntime", "torch", "tensorrt")


def use_threads(threads: int | None, flag: str = "--threads") -> int:
    """Resolve `threads` (None: `default_threads()`, plugins/threads.py), set torch's count, and return it (the
    callers give it to ONNX Runtime's intra-op pool)."""
    n = default_threads() if threads is None else threads
    if n < 1:
        raise ConfigError(f"{flag} {n}: must be >= 1 (default: OMP_NUM_THREADS, else the cores this process may use)")
    set_threads(n)
    return n


def torch_threads() -> int:
    """The count torch runs with now (what a run's summary reports)."""
    import torch

    return torch.get_num_threads()


def load_tokenizer(directory: Path):
    """tokenizer.json via the `tokenizers` library, or None when the directory has none; one that does not load is
    a TokenizerConfigError (a ValueError: one line and exit 2 from mtp-run and mtp-serve)."""
    from models.tokenizer_config import load_tokenizer_file

    return load_tokenizer_file(directory)


def create_engine(
    engine_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    executor: str = "auto",
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    cuda_graphs: bool = False,
    threads: int | None = None,
    seed: int = 0,
    tp_size: int | None = None,
    ep_size: int | None = None,
    collective_timeout: float = DEFAULT_TIMEOUT_S,
    prog: str | None = None,
    wrap_executor: Callable[[Executor], Executor] | None = None,
    draft_length: DraftLengthController | None = None,
    verify_lengths: VerifyLengthPolicy | None = None,
    share_executor_of: LLMEngine | None = None,
    **overrides,
) -> LLMEngine:
    """Args:
        engine_dir: a directory built by mtp-build (validated before anything runs).
        checkpoint: a Hugging Face checkpoint directory (torch executor only, no build step).
        executor: auto | compiled | onnxruntime | torch | tensorrt. auto (`resolve_executor`): an engine
            directory's compiled packages when it has them and this machine can run them (`fastest_executor`),
            else onnxruntime; a checkpoint's torch.
        device, cuda_graphs: torch executor only ("cuda" + cuda_graphs=True replays captured graphs).
        threads: onnxruntime intra-op threads (default: what the engine recorded); torch uses torch.set_num_threads.
        seed: engine seed; an unseeded request samples from a generator derived from (seed, request id).
        tp_size, ep_size: the mapping of a checkpoint run (an engine directory records its own): the weights
            are sharded at load per the mapping contract (ep_size default: world_size).
        collective_timeout, prog: multi-rank only: the watchdog's deadline and the program its line names.
        wrap_executor: wraps the executor before the engine is built (tests record or fault its calls).
        draft_length: a controller for `auto` in place of the default one (runtime/core/draft_length.py).
        verify_lengths: a per-request k_i policy in place of per-request's own (runtime/core/verify_lengths.py).
        share_executor_of: run on this engine's executor (its weights and KV pool) instead of loading another:
            engines of one model that take turns, e.g. the bench's K variants. Separate copies of the same
            weights measured up to 19% apart in speed from their memory placement alone, which swamped the
            differences between K. The engines must not run steps concurrently, and neither may cache prefixes.
        overrides: RuntimeConfig fields (max_batch, num_draft_tokens, num_blocks, ...); num_draft_tokens="auto"
            picks the draft length per step, up to the engine's built K (runtime/core/draft_length.py);
            "per-request" (the default, DEFAULT_DRAFT_TOKENS) each request's own per step (verify_lengths.py).
    """
    if executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    ecfg = load_engine_config(engine_dir) if engine_dir is not None else None
    executor = resolve_executor(executor, ecfg)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    overrides.setdefault("num_draft_tokens", DEFAULT_DRAFT_TOKENS)  # the one place the default is applied
    if overrides.get("num_draft_tokens") == "auto":  # K_max = what the engine was built for (or the default)
        del overrides["num_draft_tokens"]
        overrides["auto_draft_tokens"] = True
    elif overrides.get("num_draft_tokens") == "per-request":  # k_i per request, up to the built K
        del overrides["num_draft_tokens"]
        overrides["per_request_draft_tokens"] = True
    if engine_dir is not None and ecfg is not None:
        if ecfg.world_size != world_size:
            raise ConfigError(f"engine {engine_dir} was built for world_size={ecfg.world_size} but "
                              f"{world_size} rank(s) were launched: use mpirun -np {ecfg.world_size}")  # fmt: skip
        parallel = ecfg.parallel
        if tp_size is not None and tp_size != parallel.tp_size:
            raise ConfigError(f"--tp-size {tp_size}: engine {engine_dir} was built for tp_size={parallel.tp_size}; "
                              "drop the flag (an engine records its mapping) or rebuild with mtp-build --tp-size")  # fmt: skip
        if overrides.get("num_draft_tokens", 0) > ecfg.num_draft_tokens:  # named before RuntimeConfig's block rule
            raise ConfigError(_k_exceeds(overrides["num_draft_tokens"], ecfg.num_draft_tokens))
        cfg = replace(engine_defaults(ecfg), **overrides)
        check_within_engine(cfg, ecfg.limits, ecfg.kv, ecfg.num_draft_tokens)
        model_cfg, tokenizer = ecfg.model, load_tokenizer(Path(engine_dir))
        ex: Executor
        if share_executor_of is not None:
            ex = _shared_executor(share_executor_of, cfg)
        elif executor == "compiled":
            from runtime.executors.compiled_executor import CompiledExecutor

            ex = CompiledExecutor(engine_dir, rank=rank, num_blocks=cfg.num_blocks, mtp_modules=cfg.mtp_modules)
        elif executor == "onnxruntime":
            from runtime.executors.ort_executor import OrtExecutor

            ex = OrtExecutor(engine_dir, rank=rank, num_blocks=cfg.num_blocks, intra_op_threads=threads,
                             num_state_snapshots=cfg.state_snapshot_slots, mtp_modules=cfg.mtp_modules)
        elif executor == "tensorrt":
            from runtime.executors.trt_executor import TrtExecutor

            ex = TrtExecutor(engine_dir, rank=rank, num_blocks=cfg.num_blocks)
        else:
            checkpoint = checkpoint or ecfg.checkpoint["path"]
            ex, model_cfg = _torch_executor(checkpoint, cfg, rank, parallel, device, cuda_graphs)
    else:
        if checkpoint is None:
            raise ConfigError("give --engine DIR (built by mtp-build) or --checkpoint DIR (torch executor)")
        if executor != "torch":
            raise ConfigError(f"executor {executor!r} needs an engine directory; build one with mtp-build "
                              "or use --executor torch with --checkpoint")  # fmt: skip
        cfg = RuntimeConfig(**overrides)
        parallel = Parallel(world_size, world_size if ep_size is None else ep_size, tp_size or 1)
        if share_executor_of is not None:
            ex, model_cfg = _shared_executor(share_executor_of, cfg), share_executor_of.model_cfg
        else:
            ex, model_cfg = _torch_executor(checkpoint, cfg, rank, parallel, device, cuda_graphs)
        tokenizer = load_tokenizer(Path(checkpoint))
    if model_cfg.num_mtp_modules == 0 and cfg.num_draft_tokens:
        cfg = replace(cfg, num_draft_tokens=0)  # the checkpoint has no MTP module: plain decoding
    if wrap_executor is not None:
        ex = wrap_executor(ex)
    # collective under mpirun: every rank agrees on the settings here (RanksDisagree on every rank)
    ranks = rank_strategy(ex, model_cfg, cfg, parallel, collective_timeout, prog or Path(sys.argv[0]).stem or "mtp")
    cpu = executor in ("compiled", "onnxruntime") or (executor == "torch" and device == "cpu")
    return LLMEngine(ex, model_cfg, cfg, tokenizer, seed=seed, ranks=ranks, draft_length=draft_length,
                     verify_lengths=verify_lengths,
                     draft_clock=time.process_time if cpu else time.perf_counter, executor_name=executor)  # fmt: skip


def _shared_executor(other: LLMEngine, cfg: RuntimeConfig) -> Executor:
    """other's executor, if its KV pool has this engine's geometry and neither engine caches prefixes (a block
    one engine keeps cached would be overwritten by the other's requests)."""
    if cfg.enable_prefix_caching or other.cfg.enable_prefix_caching:
        raise ConfigError("share_executor_of: engines sharing one KV pool would overwrite each other's cached "
                          "prefix blocks; create both with enable_prefix_caching=False")  # fmt: skip
    mine, theirs = (cfg.num_blocks, cfg.block_size), (other.cfg.num_blocks, other.cfg.block_size)
    if mine != theirs:
        raise ConfigError(f"share_executor_of: the shared pool has (num_blocks, block_size) = {theirs}, this "
                          f"engine asks for {mine}; give both engines the same num_blocks and block_size")  # fmt: skip
    return other.executor


def resolve_executor(asked: str | None, ecfg: EngineConfig | None) -> str:
    """The one rule for the executor every entry point (mtp-run, both mtp-serve frontends, the Python API) runs
    when none is named, or "auto" is: an engine directory's fastest executor on this machine, a checkpoint's
    torch. A named executor is kept as asked (create_engine says if it cannot run)."""
    if asked not in (None, "auto"):
        return asked
    return "torch" if ecfg is None else fastest_executor(ecfg)


def fastest_executor(ecfg: EngineConfig) -> str:
    """The fastest executor this machine can run the engine with: its compiled packages, else ONNX Runtime (or
    TensorRT for a TensorRT engine). docs/PERFORMANCE.md ("Compiled engine") has the measured order. A compiled
    engine without ONNX weights (built without --keep-onnx) has no fallback: "compiled", whose refusal names why
    its packages cannot run here and the rebuild."""
    if ecfg.backend == "tensorrt":
        return "tensorrt"
    if compiled_problem(ecfg) is None or not ecfg.onnx_weights:  # every rank has packages, for this torch and CPU
        return "compiled"
    return "onnxruntime"


def engine_defaults(ecfg: EngineConfig) -> RuntimeConfig:
    """The runtime config an engine runs with when nothing is overridden: exactly its build limits."""
    lim = ecfg.limits
    return RuntimeConfig(max_batch=lim.max_batch, max_num_tokens=lim.max_num_tokens, max_seq_len=lim.max_seq_len,
                         block_size=ecfg.kv.block_size, num_blocks=ecfg.kv.num_blocks,
                         num_draft_tokens=ecfg.num_draft_tokens, max_prefill_chunk=lim.max_num_tokens)  # fmt: skip


def _k_exceeds(asked: int, k: int) -> str:
    return f"num_draft_tokens={asked} exceeds the {k} the engine was built for; rebuild with --num-draft-tokens {asked}"


def check_within_engine(cfg: RuntimeConfig, lim: Limits, kv: KVLayout, k: int) -> None:
    """Refuse a runtime config that could send a step the engine (limits, layout, K) was not built for; every
    step an admitted config produces fits the recorded table width and TensorRT profiles
    (tests/runtime/test_engine_limits.py)."""
    if cfg.num_draft_tokens > k:
        raise ConfigError(_k_exceeds(cfg.num_draft_tokens, k))
    for name, limit in (("max_batch", lim.max_batch), ("max_num_tokens", lim.max_num_tokens),
                        ("max_seq_len", lim.max_seq_len)):  # fmt: skip
        if getattr(cfg, name) > limit:
            raise ConfigError(f"{name}={getattr(cfg, name)} exceeds the engine's limit {limit}; lower it or rebuild "
                              f"with --{name.replace('_', '-')} {getattr(cfg, name)}")  # fmt: skip
    if cfg.block_size != kv.block_size:
        raise ConfigError(f"block_size={cfg.block_size} differs from the engine's kv.block_size={kv.block_size} "
                          "(baked into its plugin nodes); drop the override or rebuild with --kv-block-size")  # fmt: skip
    if cfg.max_blocks_per_request > kv.table_width:  # implied by the checks above; kept as the contract itself
        raise ConfigError(f"block tables of {cfg.max_blocks_per_request} blocks exceed the engine's table width "
                          f"{kv.table_width}; lower max_seq_len or num_draft_tokens")  # fmt: skip


def _torch_executor(checkpoint, cfg: RuntimeConfig, rank: int, parallel: Parallel, device: str, cuda_graphs: bool):
    """The model sliced to this rank's shards (TP heads / MLP / vocab, EP experts: the mapping contract)."""
    from models.checkpoint import load_model, read_model_config
    from runtime.executors.torch_executor import TorchExecutor

    mc = read_model_config(checkpoint)[0]
    experts = mc.n_routed_experts if mc.has_moe else 0
    w, ep, tp = parallel.world_size, parallel.ep_size, parallel.tp_size
    if mc.is_dsa and tp > 1:  # the indexer's keys and top-k are not split over a TP group yet
        raise ConfigError(f"--tp-size {tp}: {mc.model_type} uses DeepSeek Sparse Attention, which runs on one rank "
                          "per TP group only (expert parallelism is fine); use --tp-size 1")  # fmt: skip
    try:
        check_model(w, ep, tp, num_experts=experts, num_heads=mc.num_attention_heads,
                    num_kv_heads=mc.num_key_value_heads, vocab_size=mc.vocab_size, mla=mc.is_mla,
                    gdn_key_heads=mc.linear_num_key_heads if mc.is_hybrid else 0)  # fmt: skip
        mapping = rank_mapping(rank, parallel, experts)
    except MappingError as e:
        raise ConfigError(f"{e} (--checkpoint {checkpoint})") from None
    model, _ = load_model(checkpoint, mapping=mapping)
    executor = TorchExecutor(model, cfg.num_blocks, cfg.block_size, device=device, cuda_graphs=cuda_graphs,
                             max_batch=cfg.max_batch, num_draft_tokens=cfg.num_draft_tokens,
                             max_blocks_per_request=cfg.max_blocks_per_request,
                             num_state_snapshots=cfg.state_snapshot_slots, mtp_modules=cfg.mtp_modules)  # fmt: skip
    return executor, model.cfg

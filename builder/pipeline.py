"""The build as a pipeline of small named steps, all-or-nothing on disk.

    check options -> check --output -> import checkpoint (headers, weights, tokenizer) -> check memory
    -> export ONNX (per graph per rank) [-> AOTInductor packages (--compile aoti) -> one weight store per rank]
    -> backend build [-> drop the ONNX weights (compiled, without --keep-onnx)] -> write config + checksums -> atomic rename

Every check (builder/validate.py) runs before anything is written. Everything is written into a temporary
directory next to the output (same filesystem, so the final `os.replace` is atomic) and renamed into place
only when every step succeeded; a failure, or SIGTERM/SIGINT/SIGHUP (`BuildInterrupted`), removes it.
Progress goes to a `Reporter` (the CLI draws it with rich; tests pass a silent one).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import onnx
import torch

from builder import compile_aoti, ort_build, rank_graphs, signals, trt_build, validate
from builder.export import export_graph
from builder.fused_draft import fused_modules
from builder.options import BuildError, BuildOptions
from builder.pool_weights import pool_rank_weights
from builder.rank_process import run_in_child
from models.checkpoint import (
    CheckpointError,
    check_weights,
    checkpoint_hash,
    index_checkpoint,
    load_fp8_weights,
    load_model,
    plan_weights,
    rank_weight_bytes,
    read_model_config,
)
from models.config import ModelConfig
from models.engine_format import (
    SCHEMA_VERSION,
    EngineConfig,
    KVLayout,
    Parallel,
    load_engine_config,
    rank_dir,
    write_engine_config,
)
from models.engine_format.graph_io import engine_graphs
from models.engine_format.weight_store import STORE_NAME
from plugins.mapping import RankMapping, rank_mapping
from plugins.names import installed_plugins

COMPILED_INFO = "compiled.json"  # a rank's compile record, moved into config.json's build.compiled
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")  # fmt: skip


class Reporter(Protocol):
    def step(self, name: str) -> None: ...

    def done(self, what: str, seconds: float) -> None: ...

    def track(self, items: Sequence[str], what: str) -> Iterable[str]:
        """items, shown as a progress bar while they are worked on (the compile's graphs: minutes each)."""
        ...


class SilentReporter:
    def step(self, name: str) -> None:
        pass

    def done(self, what: str, seconds: float) -> None:
        pass

    def track(self, items: Sequence[str], what: str) -> Iterable[str]:
        return items


@dataclass
class BuildResult:
    config: EngineConfig
    seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)


def check_output(opts: BuildOptions) -> None:
    """Refuse an --output that overlaps the checkpoint or is not ours to replace (builder/validate.py)."""
    validate.check_output(opts.checkpoint, opts.output, opts.force)


Template = tuple[int, dict[str, dict[str, str]]]  # (rank, {graph: its module's tensor digests}): rank_graphs.py


def _export_shard(rank: int, opts: BuildOptions, work: Path, layout: KVLayout, template: Template | None,
                  shares: bool, rep: Reporter) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:  # fmt: skip
    """A multi-rank build's rank (in its child): its graphs, and (shares) those the ranks it templates may copy."""
    swappable: dict[str, dict[str, str]] = {}
    return _export_rank(rank, opts, work, layout, rep, template, swappable if shares else None), swappable


def _export_rank(rank: int, opts: BuildOptions, work: Path, layout: KVLayout, rep: Reporter,
                 template: Template | None = None, swappable: dict[str, dict[str, str]] | None = None,
                 ) -> dict[str, Any]:  # fmt: skip
    """template: the rank whose graphs this rank may write with its own weights swapped in (no export), with its
    swappable graphs; swappable: gets this rank's graphs other ranks may copy that way."""
    ckpt_cfg = read_model_config(opts.checkpoint)[0]  # config.json only
    mapping = _mapping(rank, opts, ckpt_cfg)
    state = opts.state_layout(ckpt_cfg)
    t0 = time.perf_counter()
    rep.step(f"rank {rank}: load its weights")
    model, _ = load_model(opts.checkpoint, opts.torch_dtype, mapping=mapping)
    rep.done(f"rank {rank}: weights", time.perf_counter() - t0)
    rdir = work / rank_dir(rank)
    rdir.mkdir()
    graphs: dict[str, dict[str, str]] = {}
    for name in engine_graphs(model.cfg):  # graph_io.py: one draft graph per MTP module where depth d runs module d
        t0 = time.perf_counter()
        path, geom = rdir / f"{name}.onnx", None if state is None else state.geometry()
        tensors = rank_graphs.graph_tensors(name, model, layout.geometry(), geom) if opts.world_size > 1 else {}
        src, digests = (None, {}) if template is None else (work / rank_dir(template[0]) / path.name, template[1])
        if src is not None and name in digests and rank_graphs.fits(src, digests[name], tensors):
            data = rank_graphs.swap_weights(src, path, tensors)  # the template rank's graph, this rank's weights
            rep.step(f"rank {rank}: {name} is {src.parent.name}'s graph with this rank's weights (no export)")
        else:
            rep.step(f"rank {rank}: export {name} ({_shard_note(model.cfg, model.mapping)})")
            data = export_graph(name, model, layout.geometry(), layout.table_width, path, geom)
            if swappable is not None and rank_graphs.swappable(path, tensors):
                swappable[name] = rank_graphs.digests(tensors)
        graphs[name] = {"onnx": str(path.relative_to(work)), "data": str(data.relative_to(work))}
        rep.done(f"rank {rank}: {name}.onnx", time.perf_counter() - t0)
    if opts.compile == "aoti":  # while this rank's weights are loaded (builder/compile_aoti.py)
        t0 = time.perf_counter()
        rep.step(f"rank {rank}: AOTInductor compile {', '.join(graphs)} (seconds to minutes per graph)")
        # an FP8 release's dense weights as released (bytes + block scales): the packages keep them FP8
        fp8 = load_fp8_weights(opts.checkpoint, mapping) if opts.torch_dtype == torch.float32 else {}
        compiled = compile_aoti.compile_rank(model, layout.geometry(), layout.table_width, rdir, work, graphs,
                                            compile_aoti.model_weights(model), rep.track, fp8,
                                            opts.graph_quantize, opts.quantize_lm_head, opts.int4_group_size,
                                            None if state is None else
                                            compile_aoti.compiled_state(state.geometry(), opts.max_batch),
                                            _fused_modules(opts, model.cfg))  # fmt: skip
        del fp8
        rep.step(f"rank {rank}: move the packages' weights into {rank_dir(rank)}/{STORE_NAME}, each weight once")
        compiled["weight_store"] = pool_rank_weights(rdir, sorted(rdir.glob("*.pt2")))  # builder/pool_weights.py
        (rdir / COMPILED_INFO).write_text(json.dumps(compiled))
        rep.done(f"rank {rank}: {len(graphs)} .pt2 packages", time.perf_counter() - t0)
    del model  # single-rank builds run this in-process; multi-rank ones run each rank in its own child
    gc.collect()
    return graphs


def _fused_modules(opts: BuildOptions, cfg: ModelConfig) -> list[int]:
    """The MTP module of each depth of the fused draft loop's package (builder/fused_draft.py), or [] for none: only
    K >= 2 (one depth is mtp_draft itself) on one rank (lockstep ranks keep the per-depth loop: draft_loop.py)."""
    if opts.num_draft_tokens < 2 or opts.world_size != 1 or not cfg.num_mtp_modules:
        return []
    return fused_modules(cfg, opts.num_draft_tokens)


def _mapping(rank: int, opts: BuildOptions, cfg: ModelConfig) -> RankMapping:
    """This rank's shards (plugins/mapping.py); config.json keeps only `parallel`."""
    experts = cfg.n_routed_experts if cfg.has_moe else 0
    return rank_mapping(rank, Parallel(opts.world_size, opts.ep_size, opts.tp_size), experts)


def _shard_note(cfg: ModelConfig, m: RankMapping) -> str:
    experts = f"experts {m.expert_lo}..{m.expert_hi - 1} of {m.num_experts}" if cfg.has_moe else "no experts"
    return experts if m.tp == 1 else f"tp rank {m.tp_rank}/{m.tp} of DP group {m.dp_rank}, {experts}"


def _backend(opts: BuildOptions, cfg: ModelConfig, work: Path, graphs: list[dict[str, dict[str, str]]],
             layout: KVLayout, rep: Reporter) -> dict[str, Any]:  # fmt: skip
    info: dict[str, Any] = {}
    if opts.backend == "onnxruntime" and not opts.onnx_weights(cfg):
        return info  # no ONNX Runtime here: the ONNX graphs keep no weights (_drop_onnx_weights)
    if opts.backend == "onnxruntime":
        info["ort_session_options"] = ort_build.SESSION_OPTIONS
        notes: dict[str, str] = {}
        for rank, per_graph in enumerate(graphs):
            for name, files in per_graph.items():
                t0 = time.perf_counter()
                rep.step(f"rank {rank}: onnxruntime-optimize {name}")
                optimized, note = ort_build.optimize_graph(work / files["onnx"])
                if optimized is not None:
                    files["ort_optimized"] = str(optimized.relative_to(work))
                notes[f"{rank_dir(rank)}/{name}"] = note
                rep.done(f"rank {rank}: {name}.ort.onnx", time.perf_counter() - t0)
        info["ort_optimized"] = notes
    else:
        cache = work / trt_build.TIMING_CACHE
        old_cache = opts.output / trt_build.TIMING_CACHE
        if old_cache.is_file():  # a rebuild on the same GPU reuses the previous tactics
            shutil.copyfile(old_cache, cache)
        plans: dict[str, Any] = {}
        for rank, per_graph in enumerate(graphs):
            for name, files in per_graph.items():
                t0 = time.perf_counter()
                rep.step(f"rank {rank}: tensorrt build {name}")
                plan = work / rank_dir(rank) / f"{name}.plan"
                profiles = trt_build.profile_dims(name, opts.limits(), layout, opts.num_draft_tokens)
                plans[f"{rank_dir(rank)}/{name}"] = trt_build.build_plan(name, work / files["onnx"], plan, cache, profiles)
                files["plan"] = str(plan.relative_to(work))
                rep.done(f"rank {rank}: {name}.plan", time.perf_counter() - t0)
        info["tensorrt"] = {"timing_cache": trt_build.TIMING_CACHE, "strongly_typed": True, "plans": plans}
    return info


def _drop_onnx_weights(work: Path, graphs: list[dict[str, dict[str, str]]], rep: Reporter) -> None:
    """A compiled engine's ONNX graphs without their weights: each `.onnx.data` removed (after every rank's export:
    a multi-rank build's ranks copy their template rank's) and its `data` entry with it. The graph protos stay: the
    I/O contract, plugin attributes and weight shapes `load_engine_config` cross-checks (read without weights)."""
    rep.step("drop the ONNX weights: the compiled packages hold their own (--keep-onnx keeps them for onnxruntime)")
    for per_graph in graphs:
        for files in per_graph.values():
            (work / files.pop("data")).unlink()


def _copy_tokenizer(opts: BuildOptions, work: Path, tokenizer: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if name == "tokenizer.json" and tokenizer == validate.IDS_ONLY:
            continue
        src = opts.checkpoint / name
        if src.is_file():
            shutil.copyfile(src, work / name)
            copied.append(name)
    return copied


def _install(work: Path, output: Path) -> None:
    """Move the finished build into place; an old output is removed only after the new one is in place."""
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        os.replace(output, old)
    os.replace(work, output)
    shutil.rmtree(old, ignore_errors=True)


def _import(opts: BuildOptions, rep: Reporter) -> tuple[ModelConfig, str, str, int]:
    """Check everything the build needs from the checkpoint: (config, sha256, tokenizer, weight bytes per rank).

    From config.json and the shard headers only (names, dtypes, shapes, FP8 scales): no tensor data is read
    here; each rank's export reads its own share (and checks its values are finite) in `_export_rank`."""
    rep.step("import checkpoint")
    try:
        idx = index_checkpoint(opts.checkpoint)
        plan = plan_weights(idx)
        check_weights(plan.config, plan.shapes(), opts.checkpoint)
        if opts.num_draft_tokens and idx.config.num_mtp_modules and not plan.config.num_mtp_modules:
            raise BuildError(f"config.json says num_nextn_predict_layers={idx.config.num_mtp_modules} but the checkpoint "
                             f"has no MTP weights (model.layers.{idx.config.num_hidden_layers}.*; some quantization "
                             "tools drop them): build with --num-draft-tokens 0 for plain decoding, or use the "
                             "release that ships its MTP layers")  # fmt: skip
        # the weights' config: without MTP weights the engine has no MTP graphs
        opts.validate_for_model(plan.config, fp8_checkpoint=idx.fp8 is not None)
        weight_bytes = rank_weight_bytes(plan, opts.torch_dtype, _mapping(0, opts, plan.config))  # equal shards
        ckpt_hash = checkpoint_hash(opts.checkpoint)
    except CheckpointError as e:
        raise BuildError(str(e)) from e
    except OSError as e:
        raise BuildError(f"cannot read the checkpoint: {e.strerror or e} ({e.filename}); check its files") from e
    tokenizer = validate.check_tokenizer(opts.checkpoint, idx.config.vocab_size)
    if tokenizer == validate.IDS_ONLY:
        rep.step("no tokenizer.json in the checkpoint: the engine is ids-only (requests must be token ids; "
                 "text prompts will be refused)")  # fmt: skip
    return plan.config, ckpt_hash, tokenizer, weight_bytes


def _make_work_dir(output: Path) -> Path:
    work = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
    except OSError as e:
        raise BuildError(f"cannot create the build directory {work}: {e.strerror or e}; choose an --output on a "
                         "writable filesystem") from e  # fmt: skip
    return work


def build(opts: BuildOptions, rep: Reporter | None = None) -> BuildResult:
    rep = rep or SilentReporter()
    with signals.raising():
        return _build(opts, rep)


def _build(opts: BuildOptions, rep: Reporter) -> BuildResult:
    t_start = time.perf_counter()
    opts.validate()
    if opts.backend == "tensorrt":
        missing = trt_build.tensorrt_missing()
        if missing:
            raise BuildError(f"--backend tensorrt cannot build here: {missing}. Use --backend onnxruntime on CPU")
    check_output(opts)
    ckpt_cfg, ckpt_hash, tokenizer, weight_bytes = _import(opts, rep)
    compile_kind, why = opts.resolve_compile(ckpt_cfg)
    if opts.compile == "auto":
        rep.step(f"--compile auto: {compile_kind} ({why})")
    opts = replace(opts, compile=compile_kind)  # config.json records what was built
    layout = opts.kv_layout(ckpt_cfg)
    need = validate.memory_estimate(layout.geometry(), weight_bytes, layout.table_width)
    device = "cuda" if opts.backend == "tensorrt" else "cpu"
    validate.check_memory(need, validate.machine_memory(device), opts.max_batch)
    work = _make_work_dir(opts.output)
    try:
        try:
            cfg = _write_engine(opts, work, rep, ckpt_cfg, ckpt_hash, tokenizer, layout)
        except CheckpointError as e:
            raise BuildError(str(e)) from e
        except OSError as e:
            raise BuildError(f"writing the engine failed: {e.strerror or e} ({e.filename}); free space or choose "
                             "another --output") from e  # fmt: skip
    except BaseException:
        with signals.held():
            shutil.rmtree(work, ignore_errors=True)
        raise
    cfg.path = opts.output
    return BuildResult(cfg, time.perf_counter() - t_start)


def _write_engine(opts: BuildOptions, work: Path, rep: Reporter, ckpt_cfg: ModelConfig, ckpt_hash: str,
                  tokenizer: str, layout: KVLayout) -> EngineConfig:  # fmt: skip
    if opts.world_size == 1:
        graphs = [_export_rank(0, opts, work, layout, rep)]
    else:  # one child per rank: each rank's weights leave memory with it (builder/rank_process.py says why)
        graphs, shared = [], dict[int, dict[str, dict[str, str]]]()  # template rank -> its graphs that the ranks of its graph_key may copy
        templates = rank_graphs.templates([_mapping(r, opts, ckpt_cfg) for r in range(opts.world_size)])
        for r, t in enumerate(templates):
            args = (r, opts, work, layout, None if t is None else (t, shared[t]), r in templates)
            own, shared[r] = run_in_child(_export_shard, args, rep, f"rank {r}'s export")
            graphs.append(own)
    backend_info = _backend(opts, ckpt_cfg, work, graphs, layout, rep)
    if not opts.onnx_weights(ckpt_cfg):
        _drop_onnx_weights(work, graphs, rep)
    if opts.compile != "none":
        backend_info["compiled"] = {"kind": opts.compile, **_compiled_record(work, opts.world_size)}
    rep.step("write config + checksums")
    cfg = EngineConfig(
        path=work, schema_version=SCHEMA_VERSION, model=ckpt_cfg, dtype=opts.dtype, limits=opts.limits(),
        kv=layout, num_draft_tokens=opts.num_draft_tokens,
        parallel=Parallel(opts.world_size, opts.ep_size, opts.tp_size),
        plugins=installed_plugins(), backend=opts.backend,
        build={"options": opts.to_json(), "torch_version": torch.__version__, "onnx_version": onnx.__version__,
               "onnx_opset": _opset(work / graphs[0]["main"]["onnx"]), "tokenizer": tokenizer, **backend_info},
        checkpoint={"path": str(opts.checkpoint.resolve()), "sha256": ckpt_hash},
        tokenizer_files=_copy_tokenizer(opts, work, tokenizer), graphs=graphs, state=opts.state_layout(ckpt_cfg),
    )  # fmt: skip
    write_engine_config(cfg)
    load_engine_config(work)  # what the runtime will run: refuse to install a directory that fails it
    rep.step("atomic rename")
    with signals.held():  # never leave the old engine moved aside and the new one not yet in place
        _install(work, opts.output)
    return cfg


def _compiled_record(work: Path, world_size: int) -> dict[str, Any]:
    """config.json's `build.compiled`: rank 0's compile record, after checking every rank's agrees with it on
    what `compiled_problem` checks at load (torch version, ISA) and on the weight storage (equal shards)."""
    records = []
    for rank in range(world_size):
        path = work / rank_dir(rank) / COMPILED_INFO
        records.append(json.loads(path.read_text()))
        path.unlink()
    for rank, rec in enumerate(records[1:], 1):
        for key in ("torch_version", "isa", "weights"):
            if rec[key] != records[0][key]:
                raise BuildError(f"rank {rank}'s packages were compiled with {key}={rec[key]!r}, rank 0's with "
                                 f"{records[0][key]!r}; build every rank on one machine and torch")  # fmt: skip
    return records[0]


def _opset(path: Path) -> int:
    m = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))

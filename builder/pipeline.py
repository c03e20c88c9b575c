"""The build as a pipeline of small named steps, all-or-nothing on disk.

    check options -> import checkpoint -> export ONNX (per graph per rank) -> backend build
    -> write config + checksums -> atomic rename

Everything is written into a temporary directory next to the output (same filesystem, so the final
`os.replace` is atomic) and renamed into place only when every step succeeded; a failure removes it.
Progress goes to a `Reporter` (the CLI draws it with rich; tests pass a silent one).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import onnx
import torch

from builder import ort_build, trt_build
from builder.export import export_graph
from builder.options import BuildError, BuildOptions
from models.checkpoint import CheckpointError, checkpoint_hash, load_model, read_model_config
from models.config import ModelConfig
from plugins.engine_format import (
    SCHEMA_VERSION,
    EngineConfig,
    KVLayout,
    Parallel,
    load_engine_config,
    looks_like_engine_dir,
    rank_dir,
    write_engine_config,
)
from plugins.engine_format.names import installed_plugins

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")  # fmt: skip


class Reporter(Protocol):
    def step(self, name: str) -> None: ...

    def done(self, what: str, seconds: float) -> None: ...


class SilentReporter:
    def step(self, name: str) -> None:
        pass

    def done(self, what: str, seconds: float) -> None:
        pass


@dataclass
class BuildResult:
    config: EngineConfig
    seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)


def check_output(opts: BuildOptions) -> None:
    """Refuse to replace something that is not an engine directory unless --force."""
    out = opts.output
    if not out.exists():
        return
    if not out.is_dir():
        raise BuildError(f"--output {out} exists and is a file; choose another path or remove it")
    if opts.force or not any(out.iterdir()) or looks_like_engine_dir(out):
        return
    raise BuildError(
        f"--output {out} exists and is not an engine directory (no engine config.json); refusing to replace it. "
        "Choose another path, or pass --force to delete it and build there"
    )


def _graph_names(cfg: ModelConfig, opts: BuildOptions) -> list[str]:
    return ["main", "mtp_draft", "mtp_commit"] if cfg.num_mtp_modules else ["main"]


def _export_rank(rank: int, opts: BuildOptions, work: Path, layout: KVLayout, rep: Reporter) -> dict[str, Any]:
    ep_rank = rank % opts.ep_size
    model, _ = load_model(opts.checkpoint, opts.torch_dtype, ep_rank=ep_rank, ep_size=opts.ep_size)
    rdir = work / rank_dir(rank)
    rdir.mkdir()
    graphs: dict[str, dict[str, str]] = {}
    for name in _graph_names(model.cfg, opts):
        t0 = time.perf_counter()
        rep.step(f"rank {rank}: export {name} (experts {_expert_range(model.cfg, opts, ep_rank)})")
        path = rdir / f"{name}.onnx"
        data = export_graph(name, model, layout.geometry(), layout.table_width, path)
        graphs[name] = {"onnx": str(path.relative_to(work)), "data": str(data.relative_to(work))}
        rep.done(f"rank {rank}: {name}.onnx", time.perf_counter() - t0)
    return graphs


def _expert_range(cfg: ModelConfig, opts: BuildOptions, ep_rank: int) -> str:
    if not cfg.has_moe:
        return "none"
    n = cfg.n_routed_experts // opts.ep_size
    return f"{ep_rank * n}..{(ep_rank + 1) * n - 1} of {cfg.n_routed_experts}"


def _backend(opts: BuildOptions, work: Path, graphs: list[dict[str, dict[str, str]]], layout: KVLayout,
             rep: Reporter) -> dict[str, Any]:  # fmt: skip
    info: dict[str, Any] = {}
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


def _copy_tokenizer(opts: BuildOptions, work: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
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


def build(opts: BuildOptions, rep: Reporter | None = None) -> BuildResult:
    rep = rep or SilentReporter()
    t_start = time.perf_counter()
    opts.validate()
    if opts.backend == "tensorrt":
        missing = trt_build.tensorrt_missing()
        if missing:
            raise BuildError(f"--backend tensorrt cannot build here: {missing}. Use --backend onnxruntime on CPU")
    check_output(opts)
    rep.step("import checkpoint")
    try:
        ckpt_cfg, _ = read_model_config(opts.checkpoint)  # reads no tensor
        opts.validate_for_model(ckpt_cfg)
        ckpt_hash = checkpoint_hash(opts.checkpoint)
    except CheckpointError as e:
        raise BuildError(str(e)) from e
    layout = opts.kv_layout(ckpt_cfg)
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    work = opts.output.with_name(f".{opts.output.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        graphs = [_export_rank(r, opts, work, layout, rep) for r in range(opts.world_size)]
        backend_info = _backend(opts, work, graphs, layout, rep)
        rep.step("write config + checksums")
        cfg = EngineConfig(
            path=work, schema_version=SCHEMA_VERSION, model=ckpt_cfg, dtype=opts.dtype, limits=opts.limits(),
            kv=layout, num_draft_tokens=opts.num_draft_tokens,
            parallel=Parallel(opts.world_size, opts.ep_size, opts.tp_size),
            plugins=installed_plugins(), backend=opts.backend,
            build={"options": opts.to_json(), "torch_version": torch.__version__, "onnx_version": onnx.__version__,
                   "onnx_opset": _opset(work / graphs[0]["main"]["onnx"]), **backend_info},
            checkpoint={"path": str(opts.checkpoint.resolve()), "sha256": ckpt_hash},
            tokenizer_files=_copy_tokenizer(opts, work), graphs=graphs,
        )  # fmt: skip
        write_engine_config(cfg)
        load_engine_config(work)  # what the runtime will run: refuse to install a directory that fails it
        rep.step("atomic rename")
        _install(work, opts.output)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    cfg.path = opts.output
    return BuildResult(cfg, time.perf_counter() - t_start)


def _opset(path: Path) -> int:
    m = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))

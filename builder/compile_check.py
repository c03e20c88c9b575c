"""`mtp-build --check` of an engine's compiled packages: they load here and compute what the torch model computes.

The checksums (models/engine_format) already prove the packages are the files the build wrote; this proves
they still run on this installation (torch version, CPU ISA, plugin ops) and agree with models/glm4_moe.py on
a probe batch: a mixed main step (a prefill request, a verify request, a padded request), one draft depth, one
commit write and, where the engine has it, the fused draft loop (ragged depths and a padding row), each on its own
pool and on the torch model's pool, compared output by output and plane by plane. The torch model is rebuilt from the checkpoint the engine records; without it the probe is skipped
(said in the returned line). An engine built with `--quantize int8` is probed against that model with the same
weights quantized and dequantized (`as_built`): what its packages compute, up to summation order.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

import plugins.collectives  # noqa: F401  (the packages call the plugin ops by name; the collectives: multi-rank)
import plugins.mla_ops  # noqa: F401
import plugins.ops  # noqa: F401
from builder.fused_draft import FusedDraftGraph, fused_modules
from builder.graphs import wrapper
from builder.options import BuildError
from models.engine_format import EngineConfig, EngineDirError
from models.engine_format.compiled import AOTI_KIND, baked_state, compiled_info, compiled_problem, load_package
from models.engine_format.graph_io import DRAFT_GRAPH, FUSED_DRAFT, FUSED_KIND, draft_graphs
from models.gdn import GDNStatePool
from plugins.kv_pool import allocate_pool, pool_address
from plugins.reference import dequantize_int4_ref, dequantize_int8_ref, quantize_int4, quantize_int8

TOLERANCE = 1e-4  # fp32 math on both sides: differences are summation order only (~1e-6 measured)
CHECK_TIMEOUT_S = 300  # the multi-rank probe under mpirun (loads each rank's shard and packages: seconds here)
RESULT = "COMPILED_CHECK "  # the line a multi-rank probe's ranks report on
ROOT = Path(__file__).resolve().parents[1]


def mpirun_path() -> str | None:
    """The mpirun next to this Python (a venv's mpi4py wheel ships one), else the one on PATH."""
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


def probe_inputs(cfg: EngineConfig) -> dict[str, tuple[torch.Tensor, ...]]:
    """Step inputs of each graph (without the pool address) for a small mixed batch within the engine's limits."""
    k, bs, width = cfg.num_draft_tokens, cfg.kv.block_size, cfg.kv.table_width
    g = torch.Generator().manual_seed(0)
    prefill, verify = min(5, cfg.limits.max_num_tokens - (1 + k)), 1 + k
    tables = torch.full((3, width), -1, dtype=torch.int32)
    tables[0, : -(-prefill // bs)] = torch.arange(1, 1 + -(-prefill // bs))
    last = cfg.kv.num_blocks - 1
    tables[1, :2] = torch.tensor([last - 1, last])  # verify rows at positions bs-1 ..: crosses a block boundary
    counts = torch.tensor([prefill, verify, 0], dtype=torch.int32)
    kv_lens = torch.tensor([prefill, bs - 1 + verify, 0], dtype=torch.int32)
    t = prefill + verify
    positions = torch.cat([torch.arange(prefill), torch.arange(bs - 1, bs - 1 + verify)])
    ids = torch.randint(0, cfg.model.vocab_size, (t,), generator=g)
    h = cfg.model.hidden_size
    out: dict[str, tuple[torch.Tensor, ...]] = {
        "main": (ids, positions, counts, kv_lens, tables, torch.arange(t)),
    }
    if cfg.state is not None:  # a hybrid model: the prefill starts from slot 0, the verify from slot 1; the
        # prefill's last row and every verify row store their state in slots of their own
        write = torch.full((t,), -1, dtype=torch.int32)
        write[prefill - 1], write[prefill:] = 2, torch.arange(3, 3 + verify, dtype=torch.int32)
        out["main"] += (torch.tensor([0, 1, 0], dtype=torch.int32), write)
    if cfg.model.num_mtp_modules:
        hidden = torch.randn(3, h, generator=g)
        for name in draft_graphs(cfg.model):  # a per-module family: every module's draft graph, in module order
            out[name] = (hidden, ids[:3], torch.tensor([prefill - 1, bs, 0]), torch.tensor([1, 1, 0], dtype=torch.int32),
                         tables)  # fmt: skip
        out["mtp_commit"] = (torch.randn(t, h, generator=g), ids, counts, torch.tensor([0, bs - 1, 0], dtype=torch.int32),
                             tables)  # fmt: skip
    if cfg.graph_file(0, DRAFT_GRAPH, FUSED_KIND) is not None:  # the fused draft loop: K deep, 1 deep, a padding row
        out[FUSED_DRAFT] = (*out[DRAFT_GRAPH], torch.tensor([k, 1, k]))
    return out


def check_compiled(cfg: EngineConfig) -> str:
    """One line saying what was verified; BuildError (one line) when a package fails to load or disagrees.

    A multi-rank engine's packages call the collectives, so its probe runs under `mpirun -np W` (each rank
    against the torch model sharded to that rank, `_rank_main`); without mpirun they are only load-checked."""
    if compiled_info(cfg) is None:
        return "no compiled packages"
    problem = compiled_problem(cfg)
    if problem is not None:
        raise BuildError(problem)
    checkpoint = Path(cfg.checkpoint.get("path", ""))
    if not (checkpoint / "config.json").is_file():
        _load_all(cfg)
        return f"compiled packages load-checked only: the checkpoint {checkpoint} is not here to compare against"
    if cfg.world_size > 1:
        return _check_under_mpirun(cfg)
    from models.checkpoint import load_model

    worst, bad = probe_rank(cfg, 0, load_model(checkpoint)[0])
    if bad is not None:
        raise BuildError(_disagrees(cfg, bad, worst))
    return f"compiled packages match the torch model on a probe batch (max |diff| {worst:.1e}, pools equal)"


def probe_rank(cfg: EngineConfig, rank: int, model) -> tuple[float, str | None]:
    """(largest |diff|, the first package over TOLERANCE or None) of this rank's packages against `model` (this
    rank's shard). Every graph runs whatever the earlier ones gave, so all ranks issue the same collectives."""
    quantized = (compiled_info(cfg) or {}).get("quantized_graphs")  # absent: every graph (or none) was quantized
    left_float = set(cfg.graphs[rank]) - set(quantized) if quantized is not None else set()  # --quantize-mtp none
    float_model = copy.deepcopy(model).eval().fuse() if left_float else model
    model = as_built(cfg, model).eval().fuse()
    geom = cfg.kv.geometry()
    ours, theirs = allocate_pool(geom), allocate_pool(geom)
    state = baked_state(cfg)  # a hybrid's state pool, as its packages bake it
    our_state, their_state = (None, None) if state is None else (GDNStatePool.of(state), GDNStatePool.of(state))
    worst, bad = 0.0, None
    with torch.inference_mode():
        for name, inputs in probe_inputs(cfg).items():
            entry, kind = (DRAFT_GRAPH, FUSED_KIND) if name == FUSED_DRAFT else (name, AOTI_KIND)
            path = cfg.graph_file(rank, entry, kind)
            assert path is not None
            try:
                package = load_package(cfg, path)
                got = package(*inputs, *_pointers(name, ours, our_state))
            except EngineDirError as e:  # damaged, or no room to unpack it: its own line says which
                raise BuildError(str(e)) from None
            except Exception as e:  # a package that does not load or run here: one line naming it
                raise BuildError(f"compiled package {_rel(cfg, path)} of {cfg.path} does not run here "
                                 f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); rebuild with "
                                 "`mtp-build --compile aoti --force`") from e  # fmt: skip
            built = float_model if (DRAFT_GRAPH if name == FUSED_DRAFT else name) in left_float else model
            graph = (FusedDraftGraph(built, geom, fused_modules(cfg.model, cfg.num_draft_tokens)) if name == FUSED_DRAFT
                     else wrapper(name, built, geom, state if name == "main" else None))  # fmt: skip
            want = graph(*inputs, *_pointers(name, theirs, their_state))
            for a, b in zip(_tuple(got), _tuple(want), strict=True):
                worst = max(worst, _diff(a, b))
            worst = max(worst, _diff(ours, theirs))
            if our_state is not None and their_state is not None:  # the recurrent state each wrote
                worst = max(worst, _diff(our_state.conv, their_state.conv), _diff(our_state.ssm, their_state.ssm))
            if worst > TOLERANCE and bad is None:
                bad = _rel(cfg, path)
    return worst, bad


def _pointers(name: str, pool: torch.Tensor, state: GDNStatePool | None) -> list[torch.Tensor]:
    """The addresses graph `name` takes after its step inputs: the KV pool's (a hybrid's main: + conv, ssm)."""
    extra = [state.ref.conv_ptr, state.ref.ssm_ptr] if name == "main" and state is not None else []
    return [pool_address(pool), *extra]


def as_built(cfg: EngineConfig, model):
    """The torch model the packages implement: with `--quantize int8` (build.compiled.int8), each weight it names
    replaced, in place, by its int8 dequantization (the values mtp::linear_int8 and mtp::moe_experts_int8 multiply
    by; quantize_int8 scales an expert's rows on their own, as the build did); with `--quantize int4`, those named in
    build.compiled.int4 by their int4 dequantization (mtp::linear_int4's and mtp::moe_experts_int4's values;
    quantize_int4 groups each row of an expert stack on its own, as the build did) and the rest as with int8."""
    info = compiled_info(cfg) or {}
    int8, int4 = info.get("int8"), info.get("int4")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in int8["weights"] if int8 else []:
            params[name].copy_(dequantize_int8_ref(*quantize_int8(params[name])))
        group = int(int4["group_size"]) if int4 else 0
        for name in int4["weights"] if int4 else []:
            params[name].copy_(dequantize_int4_ref(*quantize_int4(params[name], group), group))
    return model


def _rel(cfg: EngineConfig, path: Path) -> str:
    return str(path.relative_to(cfg.path)) if path.is_relative_to(cfg.path) else path.name


def _disagrees(cfg: EngineConfig, package: str, worst: float) -> str:
    return (f"compiled package(s) {package} of {cfg.path} disagree with the torch model on the probe batch (max |diff| "
            f"{worst:.2e} > {TOLERANCE}); rebuild with `mtp-build --compile aoti --force`")  # fmt: skip


def _load_all(cfg: EngineConfig) -> None:
    """Load (not run) every rank's packages: a package this torch cannot load fails with one line."""
    for rank in range(cfg.world_size):
        fused = cfg.graph_file(rank, DRAFT_GRAPH, FUSED_KIND)
        for path in [cfg.graph_file(rank, name, AOTI_KIND) for name in cfg.graphs[rank]] + ([fused] if fused else []):
            assert path is not None
            try:
                load_package(cfg, path)
            except EngineDirError as e:
                raise BuildError(str(e)) from None
            except Exception as e:
                raise BuildError(f"compiled package {_rel(cfg, path)} of {cfg.path} does not load here "
                                 f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); rebuild with "
                                 "`mtp-build --compile aoti --force`") from e  # fmt: skip


def _check_under_mpirun(cfg: EngineConfig) -> str:
    """Run `_rank_main` on W ranks under mpirun, killed (with its ranks) after CHECK_TIMEOUT_S: never a hang."""
    mpirun = mpirun_path()
    if mpirun is None:
        _load_all(cfg)
        return (f"compiled packages of {cfg.world_size} ranks load-checked only: their probe runs under mpirun, "
                "which is not on PATH")  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    if os.geteuid() == 0:  # Open MPI refuses root without these (containers run as root)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "-np", str(cfg.world_size), "--oversubscribe", sys.executable, "-m", "builder.compile_check",
           str(cfg.path)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise BuildError(f"the probe of {cfg.path}'s compiled packages under mpirun -np {cfg.world_size} did not end in "
                         f"{CHECK_TIMEOUT_S}s (a rank stuck in a collective?); rerun with --debug or rebuild") from None  # fmt: skip
    lines = [ln.removeprefix(RESULT).strip() for ln in output.splitlines() if ln.startswith(RESULT)]
    errors = [ln for ln in lines if ln.startswith("rank ")]
    if errors:
        raise BuildError(errors[0])
    if proc.returncode != 0 or not lines:
        tail = " ".join(output.split())[-300:]
        raise BuildError(f"the probe of {cfg.path}'s compiled packages under mpirun -np {cfg.world_size} failed (exit "
                         f"{proc.returncode}): {tail}")  # fmt: skip
    worst, bad = json.loads(lines[-1])
    if bad is not None:
        raise BuildError(_disagrees(cfg, bad, worst))
    return (f"compiled packages of {cfg.world_size} ranks match the torch model (each rank's shard, under mpirun) on "
            f"a probe batch (max |diff| {worst:.1e}, pools equal)")  # fmt: skip


def _rank_main(engine: str) -> int:
    """One rank of `_check_under_mpirun`: probe this rank's packages; rank 0 prints the result line. A rank that
    fails prints its line and aborts the world (the others would wait in a collective)."""
    from mpi4py import MPI

    from models.checkpoint import load_model
    from models.engine_format import load_engine_config
    from plugins.collectives import groups
    from plugins.mapping import rank_mapping

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        cfg = load_engine_config(engine, verify_checksums=False)  # the parent verified them
        groups(cfg.parallel.tp_size)  # the communicators, made by every rank before any collective
        mapping = rank_mapping(rank, cfg.parallel, cfg.model.n_routed_experts if cfg.model.has_moe else 0)
        result = probe_rank(cfg, rank, load_model(cfg.checkpoint["path"], mapping=mapping)[0])
    except BaseException as e:  # noqa: BLE001 - the parent gets one line; the other ranks must not wait
        print(f"{RESULT}rank {rank}: {' '.join(str(e).split())[:400]}", flush=True)
        comm.Abort(2)
    results = comm.gather(result, root=0)
    if results is not None:  # rank 0
        worst = max(w for w, _ in results)
        bad = [b for _, b in results if b is not None]  # a wrong rank's error reaches its TP group's all-reduces
        print(RESULT + json.dumps([worst, ", ".join(bad) or None]), flush=True)
    return 0


def _tuple(x) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.dtype.is_floating_point:
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


if __name__ == "__main__":  # python -m builder.compile_check ENGINE_DIR, under mpirun (by `_check_under_mpirun`)
    sys.exit(_rank_main(sys.argv[1]))

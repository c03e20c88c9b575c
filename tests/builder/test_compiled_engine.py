"""`mtp-build` (its default `--compile auto` is `aoti` here): the AOTInductor packages reproduce the torch executor
(outputs and every KV plane), greedy decoding through them is lossless, `--check` verifies them, and `auto` runs them.

One compiled build of the package's tiny checkpoint (tests/builder/conftest.py `compiled_build`, shared with
test_fused_draft_engine.py) serves every test; it is built with no --compile flag, so it is also what a user who follows
the README gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from builder import cli
from models.checkpoint import load_model
from models.engine_format import EngineDirError, load_engine_config, write_engine_config
from models.engine_format.compiled import load_package
from runtime.core.sampling import SamplingParams
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.executors.torch_executor import TorchExecutor
from runtime.factory import create_engine
from tests.builder.conftest import COMPILED_K, LIMITS
from tests.builder.test_ort_executor import check_ort_matches_torch
from tests.runtime.engine_utils import random_prompts

K = COMPILED_K
PROMPTS = random_prompts((5, 13, 9, 22, 3, 17), seed=0)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PARAMS = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def compiled(compiled_build):
    return compiled_build[0]


def test_default_build_compiles_and_says_so(compiled_build):
    out, printed = compiled_build
    printed = " ".join(printed.split())
    assert "--compile auto: aoti" in printed
    assert "compiled main" in printed and "compiled mtp_commit" in printed  # one line per graph, with its time
    assert "AOTInductor compile" in printed and "(rank 0)" in printed  # the summary's compile time
    graphs = load_engine_config(out).build["compiled"]["graphs"]
    # K=3 on one rank: also the fused draft loop's package (builder/fused_draft.py; tests/builder/test_fused_draft_engine.py)
    assert set(graphs) == {"main", "mtp_draft", "mtp_commit", "mtp_draft_fused"}
    assert all(g["seconds"] > 0 for g in graphs.values())


def test_run_and_serve_default_to_the_packages(compiled, capsys):
    """mtp-run with no --executor runs the packages and says so; the same rule picks onnxruntime for an engine
    without them and torch for a checkpoint (runtime/factory.py resolve_executor)."""
    from runtime import cli as run_cli
    from runtime.factory import resolve_executor
    from runtime.serving.triton_server import parser as serve_parser

    assert run_cli.main(["--engine", str(compiled), "--prompt", "x", "--max-tokens", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["executor"] == "compiled"
    ecfg = load_engine_config(compiled)
    assert resolve_executor("auto", ecfg) == resolve_executor(None, ecfg) == "compiled"
    assert resolve_executor("auto", None) == "torch" and resolve_executor("onnxruntime", ecfg) == "onnxruntime"
    with_onnx = [{name: {**files, "data": files["onnx"] + ".data"} for name, files in g.items()} for g in ecfg.graphs]
    no_packages = dataclasses.replace(ecfg, build={k: v for k, v in ecfg.build.items() if k != "compiled"},
                                      graphs=with_onnx)  # fmt: skip
    assert resolve_executor(None, no_packages) == "onnxruntime"
    # packages this machine cannot run and no ONNX weights to fall back on: compiled, which refuses naming why
    old_torch = {**ecfg.build["compiled"], "torch_version": "0"}
    stale = dataclasses.replace(ecfg, build={**ecfg.build, "compiled": old_torch})
    assert resolve_executor(None, stale) == "compiled"
    assert resolve_executor(None, dataclasses.replace(stale, graphs=with_onnx)) == "onnxruntime"
    assert serve_parser().parse_args(["--engine", str(compiled)]).executor in (None, "auto")  # -> resolve_executor


def test_config_records_the_packages(compiled):
    cfg = load_engine_config(compiled)
    assert cfg.build["compiled"]["kind"] == "aoti"
    for name, files in cfg.graphs[0].items():
        assert files["aoti"] == f"rank0/{name}.aoti.pt2" and files["aoti"] in cfg.files  # checksummed
        assert "onnx" in files and "data" not in files  # the graph protos stay (--check reads them), not their weights
    assert not list(compiled.rglob("*.data")) and not list(compiled.rglob("*.ort.onnx"))
    assert not (compiled / "rank0" / "compiled.json").exists()


def test_onnxruntime_refuses_an_engine_without_onnx_weights_in_one_line(compiled):
    with pytest.raises(EngineDirError) as e:
        create_engine(compiled, executor="onnxruntime")
    assert "carries no ONNX weights" in str(e.value) and "--keep-onnx" in str(e.value) and "\n" not in str(e.value)


def test_compiled_matches_torch_on_mixed_batch(compiled, checkpoint):
    """Mixed prefill/verify/padded main steps, a commit write, two draft depths: outputs and KV planes."""
    ex = CompiledExecutor(compiled)
    model, _ = load_model(checkpoint)
    ref = TorchExecutor(model, num_blocks=ex.geom.num_blocks, block_size=4)
    check_ort_matches_torch(ex, ref, mtp_plane=2)


def test_steps_replay_on_stable_buffers(compiled, checkpoint):
    """Invariant 10: every step refills the same preallocated buffers and hands the package views of them."""
    ex = CompiledExecutor(compiled)
    buffers = {(g, n): (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
               for g, c in ex.contexts.items() for n, b in c.buffers.items()}  # fmt: skip
    seen: list[tuple[str, int]] = []
    for name, ctx in ex.contexts.items():
        real = ctx.run

        def spy(args, real=real, name=name):
            seen.extend((name, a.data_ptr()) for a in args[:-1])  # the last one is the pool address
            return real(args)

        ctx.run = spy
    model, _ = load_model(checkpoint)
    check_ort_matches_torch(ex, TorchExecutor(model, num_blocks=ex.geom.num_blocks, block_size=4), mtp_plane=2)
    assert {g for g, _ in seen} == {"main", "mtp_draft", "mtp_commit"}
    for graph, ptr in seen:
        assert any(lo <= ptr < hi for (g, _), (lo, hi) in buffers.items() if g == graph), f"{graph}: a fresh tensor"


def _run(engine):
    outs = engine.generate(PROMPTS, PARAMS)
    engine.kv.assert_no_leaks()
    return [o.output_ids for o in outs]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return _run(create_engine(checkpoint=checkpoint, executor="torch", num_draft_tokens=0, block_size=4))


@pytest.mark.parametrize("k,chunk", [(0, 32), (1, 6), (2, 6), (3, 5)])
def test_compiled_greedy_is_lossless(compiled, reference, k, chunk):
    """Token-identical to the torch executor at K=0 (itself HF-identical, test_engine_lossless.py) for every K,
    with prefill chunks shorter than the prompts and a prefix-cache hit."""
    engine = create_engine(compiled, num_draft_tokens=k, max_prefill_chunk=chunk)
    assert isinstance(engine.executor, CompiledExecutor)  # auto: the fastest artifact present
    assert _run(engine) == reference
    assert engine.metrics.prefix_hit_tokens > 0
    if k:
        assert engine.metrics.mean_acceptance_length > 1.0  # the drafts were really verified


def test_auto_falls_back_to_onnxruntime_without_packages(engine):
    from runtime.executors.ort_executor import OrtExecutor

    assert isinstance(create_engine(engine).executor, OrtExecutor)


def test_check_verifies_the_packages(compiled, capsys):
    assert cli.main(["--check", str(compiled)]) == 0
    assert "compiled packages match the torch model on a probe batch" in " ".join(capsys.readouterr().out.split())


def _copy_with_a_flipped_byte(engine: Path, tmp_path: Path) -> Path:
    """A copy of the engine whose rank-0 main package has its middle byte flipped (the manifest not resealed)."""
    copy = tmp_path / "copy"
    shutil.copytree(engine, copy)
    pkg = copy / "rank0" / "main.aoti.pt2"
    raw = bytearray(pkg.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pkg.write_bytes(bytes(raw))
    return copy


def test_check_refuses_a_corrupted_package(compiled, tmp_path, capsys):
    copy = _copy_with_a_flipped_byte(compiled, tmp_path)
    assert cli.main(["--check", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "main.aoti.pt2" in err and "corrupted" in err


def test_check_refuses_a_resealed_wrong_package(compiled, tmp_path, capsys):
    """A package swapped for another graph's and the manifest resealed: the checksums pass, the probe does not."""
    copy = tmp_path / "copy"
    shutil.copytree(compiled, copy)
    shutil.copyfile(copy / "rank0" / "mtp_draft.aoti.pt2", copy / "rank0" / "main.aoti.pt2")
    write_engine_config(load_engine_config(copy, verify_checksums=False))
    assert cli.main(["--check", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "main.aoti.pt2" in err


def _start_up_lines(capsys, argv_tail: list[str], triton_repo: Path | None = None) -> dict[str, tuple[int, list[str]]]:
    """(exit code, stderr lines) of mtp-run and `mtp-serve --frontend openai` started on an engine (in process), and
    with triton_repo also of `mtp-serve --frontend triton` (a real tritonserver, whose stub loads the engine)."""
    from runtime import cli as run_cli
    from runtime.serving.process import free_ports
    from runtime.serving.triton_server import main as serve_main

    out = {}
    capsys.readouterr()
    rc = run_cli.main([*argv_tail, "--prompt", "x", "--max-tokens", "2"])
    out["mtp-run"] = rc, capsys.readouterr().err.strip().splitlines()
    rc = serve_main(["--frontend", "openai", *argv_tail, "--port", str(free_ports(1)[0])])
    out["mtp-serve"] = rc, capsys.readouterr().err.strip().splitlines()
    if triton_repo is not None:
        ports = [str(p) for p in free_ports(3)]
        rc = serve_main(["--frontend", "triton", *argv_tail, "--model-repo", str(triton_repo), "--http-port", ports[0],
                         "--grpc-port", ports[1], "--metrics-port", ports[2], "--ready-timeout", "240"])  # fmt: skip
        out["mtp-serve --frontend triton"] = rc, capsys.readouterr().err.strip().splitlines()
    return out


def test_a_damaged_package_is_one_line_at_start_up(compiled, tmp_path, capsys):
    """A truncated .pt2 sealed in the manifest: mtp-run said "RuntimeError: Failed to initialize zip archive ... rerun
    with --debug" (exit 1) after torch's "Loading outdated pt2 file" warning, mtp-serve a 35-line traceback, and
    `--frontend triton` (the engine loads in tritonserver's stub) "tritonserver log shows 'failed to load'" and 50
    lines of its log, exit 1. Now each prints the engine's own line and exits 2."""
    copy = tmp_path / "copy"
    shutil.copytree(compiled, copy)
    pkg = copy / "rank0" / "main.aoti.pt2"
    pkg.write_bytes(pkg.read_bytes()[: pkg.stat().st_size // 2])
    write_engine_config(load_engine_config(copy, verify_checksums=False))
    argv = ["--engine", str(copy), "--executor", "compiled"]
    for prog, (rc, lines) in _start_up_lines(capsys, argv, triton_repo=tmp_path / "repo").items():
        prog = prog.split()[0]  # the triton frontend's line is mtp-serve's too
        assert rc == 2 and len(lines) == 1, (prog, lines)
        assert lines[0].startswith(f"{prog}: error: engine file rank0/main.aoti.pt2 in {copy} is damaged (")
        assert f"rebuild it with `mtp-build --checkpoint CKPT --output {copy} --force`" in lines[0]


def test_a_flipped_byte_in_a_package_is_refused_before_serving(compiled, tmp_path, capsys):
    """Issue 31 item 9: a package with one byte flipped (its manifest not resealed) is refused by mtp-run and
    mtp-serve at start-up against the manifest's checksums, in one line, not served."""
    copy = _copy_with_a_flipped_byte(compiled, tmp_path)
    argv = ["--engine", str(copy), "--executor", "compiled"]
    for prog, (rc, lines) in _start_up_lines(capsys, argv, triton_repo=tmp_path / "repo").items():
        prog = prog.split()[0]
        assert rc != 0 and len(lines) == 1, (prog, lines)
        assert lines[0].startswith(f"{prog}: error: ") and "main.aoti.pt2" in lines[0] and "corrupted" in lines[0]


@contextlib.contextmanager
def _full_disk(limit_bytes: int):
    """Every write past `limit_bytes` into a file fails (EFBIG) while inside, as on a full disk (ENOSPC): the soft
    RLIMIT_FSIZE, with SIGXFSZ ignored so that the write fails instead of killing the process. Restored after."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def test_no_room_to_unpack_the_packages_is_one_line_and_leaves_nothing(compiled, tmp_path, capsys, monkeypatch):
    """The packages are unpacked into $TMPDIR to load. With no room there (each .so is ~1.7 MB; writes past 512 KiB
    fail) mtp-serve printed a 30-line traceback and two empty aotinductor_* folders stayed behind per start; with
    TMPDIR naming a file, the same (also through `--frontend triton`, whose stub unpacks them). Now one line naming
    the directory and the fix, exit 2, and no folder left."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    with _full_disk(512 << 10):
        started = _start_up_lines(capsys, ["--engine", str(compiled), "--executor", "compiled"])
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "a-file"))
    with_file = _start_up_lines(capsys, ["--engine", str(compiled), "--executor", "compiled"], tmp_path / "repo")
    started["TMPDIR=file"] = with_file["mtp-run"]
    started["TMPDIR=file, triton"] = with_file["mtp-serve --frontend triton"]
    for prog, (rc, lines) in started.items():
        assert rc == 2 and len(lines) == 1, (prog, lines)
        assert "could not be unpacked into the temporary directory" in lines[0] and "point TMPDIR at" in lines[0]
    assert f"directory {tmp} (" in started["mtp-run"][1][0] and f"{tmp_path / 'a-file'} (" in started["TMPDIR=file"][1][0]
    assert not list(tmp.glob("aotinductor_*")), list(tmp.iterdir())


# In a child: load the engine's packages, list TMPDIR, decode two tokens, then leave as a rank whose watchdog fired.
ABRUPT_EXIT = """
import os, sys
from pathlib import Path
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
engine = create_engine(sys.argv[1], executor="compiled")
left = sorted(p.name for p in Path(os.environ["TMPDIR"]).iterdir())
ids = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].output_ids
print(left, len(ids), flush=True)
os._exit(1)
"""


def test_a_rank_that_leaves_abruptly_leaves_no_unpacked_package(compiled, tmp_path):
    """torch's loader unpacks each package into TMPDIR/aotinductor_* and removed it only at a normal exit, so a rank
    leaving through its watchdog (os._exit) or killed left every package's folder behind (3 per engine here; a real
    model's weights). Now each load unpacks into a private folder removed right after it: TMPDIR is empty once the
    engine is loaded, the engine still decodes, and an os._exit leaves nothing."""
    import os
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", ABRUPT_EXIT, str(compiled)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout.strip() == "[] 2", proc.stdout + proc.stderr[-2000:]
    assert sorted(p.name for p in tmp.iterdir()) == []


def test_compile_needs_onnxruntime(checkpoint, tmp_path, capsys):
    """Multi-rank compiled engines are tests/runtime/test_mpi_tp.py's; TensorRT engines have no CPU packages."""
    argv = ["--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--compile", "aoti", "--backend",
            "tensorrt"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "--compile aoti builds CPU packages (one set per rank): use it with --backend onnxruntime" in " ".join(
        capsys.readouterr().err.split())  # fmt: skip


def test_num_blocks_above_the_built_pool_is_refused(compiled):
    cfg = load_engine_config(compiled)
    with pytest.raises(ValueError, match="baked into its packages"):
        CompiledExecutor(compiled, num_blocks=cfg.kv.num_blocks + 1)
    assert CompiledExecutor(compiled, num_blocks=8).pool.shape[2] == cfg.kv.num_blocks


def test_steps_past_the_limits_are_refused(compiled):
    from runtime.executors.base import DraftInput

    ex = CompiledExecutor(compiled)
    n = LIMITS["max_batch"] + 1
    width = load_engine_config(compiled).kv.table_width
    big = DraftInput(np.zeros((n, ex.hidden_size), np.float32), np.zeros(n, np.int64), np.zeros(n, np.int64),
                     np.zeros(n, np.int32), np.full((n, width), -1, np.int32))  # fmt: skip
    with pytest.raises(ValueError, match="limits allow"):
        ex.run_draft(big)


def test_bf16_exact_weights_are_stored_bf16_and_math_stays_fp32(tmp_path):
    """A checkpoint whose matrices are bf16 numbers (models/deep): the package keeps them bf16, every dense linear
    reads them through mtp::linear_bf16 (the routed experts through the experts op), nothing is upcast per step,
    and it computes what the fp32 torch model computes, KV writes included."""
    import torch

    from builder.compile_aoti import compile_graph
    from builder.graphs import DraftGraph
    from models.testing import random_model, tiny_config
    from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address

    cfg = tiny_config()
    model = random_model(cfg, 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(p.bfloat16().float())
    model = model.fuse()
    geom = KVPoolGeometry(model.num_kv_planes, 16, 4, cfg.num_key_value_heads, cfg.head_dim)
    info = compile_graph("mtp_draft", model, geom, 4, tmp_path / "draft.pt2", "checkpoint")
    assert info["bf16_weights"] > 0 and info["inductor"]["freezing"] is False and info["weights"] == "checkpoint"
    # eh_proj, QKV, o_proj, shared-expert gate|up and down, router, lm_head: 7 linears, no weight upcast left
    assert info["bf16_linears"] == 7 and info["upcast_bytes"] == 0
    g = torch.Generator().manual_seed(0)
    tables = torch.tensor([[1, 2, -1, -1], [3, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    args = (torch.randn(3, cfg.hidden_size, generator=g), torch.tensor([5, 9, 0]), torch.tensor([5, 2, 0]),
            torch.tensor([1, 1, 0], dtype=torch.int32), tables)  # fmt: skip
    ours, theirs = allocate_pool(geom), allocate_pool(geom)
    with torch.inference_mode():
        got = load_package(SimpleNamespace(path=tmp_path), tmp_path / "draft.pt2")(*args, pool_address(ours))
        want = DraftGraph(model, geom)(*args, pool_address(theirs))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert ours.abs().sum() > 0

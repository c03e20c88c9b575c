"""FP8 releases run as FP8: `mtp-build --compile aoti` of an FP8 checkpoint (float8_e4m3fn + 128x128 block scales, as
DeepSeek-V3 / GLM-4.5-FP8 ship them) keeps those weights FP8 inside the AOTInductor packages, read by mtp::linear_fp8
and mtp::moe_experts_fp8 (fp32 math in registers), decodes exactly what the fp32-dequantized model decodes, and each
package's weights take about the checkpoint's bytes. Its EP2 build (`--world-size 2 --ep-size 2`, `fp8_ep2_engine`)
keeps each rank's routed experts FP8 too, read by mtp::moe_experts_fp8_exchange, and decodes under a real mpirun what
the single-rank FP8 engine decodes.

One compiled build of a tiny FP8 checkpoint whose dims cross 128-blocks (hidden 160, dense MLP 272, experts 136,
4 heads x 40: full and partial blocks in both dims) serves every test; the reference is the torch executor on the
same checkpoint, which dequantizes at load (models/checkpoint.py).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from builder import cli
from models.engine_format import load_engine_config
from models.engine_format.compiled import FP8_FORMAT, compiled_problem
from models.engine_format.weight_store import STORE_NAME
from models.testing import make_checkpoint, quantize_checkpoint_fp8, tiny_config, tiny_mla_config
from runtime.core.sampling import SamplingParams
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.factory import create_engine
from tests.builder.conftest import LIMITS, write_tokenizer
from tests.builder.quantized_ep import EP2_FLAGS, assert_ep2_equals_single_rank, package_constants, package_ops
from tests.runtime.engine_utils import random_prompts

CFG = tiny_config(hidden_size=160, intermediate_size=272, moe_intermediate_size=136, head_dim=40)
PROMPTS = random_prompts((5, 13, 9, 22, 3), seed=1)
PARAMS = SamplingParams(max_tokens=20)
GRAPHS = ("main", "mtp_draft", "mtp_commit")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8native")
    make_checkpoint(root / "float", CFG, seed=7)
    quantize_checkpoint_fp8(root / "float", root / "fp8")
    write_tokenizer(root / "fp8" / "tokenizer.json", CFG.vocab_size)
    return root / "fp8"


def _build(checkpoint: Path, out: Path, *extra: str) -> Path:
    argv = ["--checkpoint", str(checkpoint), "--output", str(out), "--compile", "aoti", *extra]
    for k, v in LIMITS.items():  # num_draft_tokens 2
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def fp8_engine(fp8_checkpoint, tmp_path_factory) -> Path:
    return _build(fp8_checkpoint, tmp_path_factory.mktemp("fp8native_engine") / "engine")


@pytest.fixture(scope="module")
def fp8_ep2_engine(fp8_checkpoint, tmp_path_factory) -> Path:
    """The EP2 build of the same checkpoint: rank r holds routed experts 2r..2r+1 of 4."""
    return _build(fp8_checkpoint, tmp_path_factory.mktemp("fp8native_ep2") / "engine", *EP2_FLAGS)


def _checkpoint_bytes(ckpt: Path) -> dict[str, int]:
    """Stored bytes of every checkpoint tensor (an FP8 weight's include its scale's)."""
    out: dict[str, int] = {}
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
            t = f.get_slice(name)
            n = 1
            for d in t.get_shape():
                n *= d
            size = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
            base = name.removesuffix("_scale_inv")
            out[base] = out.get(base, 0) + n * size
    return out


def test_fp8_weights_stay_fp8(fp8_engine):
    """Every dense linear whose release weight is FP8 reads it as FP8 (attention q/k/v/o, the dense MLP, the shared
    experts, eh_proj), so do the routed experts, and config.json records the format and the ops the packages need."""
    compiled = load_engine_config(fp8_engine).build["compiled"]
    assert compiled["fp8"] == {**FP8_FORMAT, "ops": ["linear_fp8", "moe_experts_fp8"]}
    graphs = compiled["graphs"]
    # main: 2 layers x (q, k, v, o) + dense MLP (3) + shared expert (3); draft: eh_proj + 4 + 3; commit: eh_proj + k + v
    assert [graphs[g]["fp8_linears"] for g in GRAPHS] == [14, 8, 3]
    assert [graphs[g]["fp8_experts"] for g in GRAPHS] == [1, 1, 0]  # the MoE layer's, the MTP layer's; none
    assert [graphs[g]["fp8_weights"] for g in GRAPHS] == [16, 10, 3]  # + w_gate_up and w_down per experts node
    assert compiled_problem(load_engine_config(fp8_engine)) is None


def test_check_probes_the_fp8_packages(fp8_engine, capsys):
    """`mtp-build --check` runs the packages against the fp32-dequantized torch model on its probe batch."""
    assert cli.main(["--check", str(fp8_engine)]) == 0
    assert "compiled packages match the torch model on a probe batch" in " ".join(capsys.readouterr().out.split())


@pytest.fixture(scope="module")
def reference(fp8_checkpoint):
    """Greedy tokens of the fp32-dequantized model (torch executor on the FP8 checkpoint, K=0)."""
    engine = create_engine(checkpoint=fp8_checkpoint, executor="torch", num_draft_tokens=0, block_size=4)
    return [o.output_ids for o in engine.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("k", [0, 2])
def test_greedy_output_equals_the_dequantized_model(fp8_engine, reference, k):
    engine = create_engine(fp8_engine, num_draft_tokens=k, max_prefill_chunk=6)
    assert isinstance(engine.executor, CompiledExecutor)
    outs = engine.generate(PROMPTS, PARAMS)
    engine.kv.assert_no_leaks()
    assert [o.output_ids for o in outs] == reference
    if k:
        assert engine.metrics.mean_acceptance_length > 1.0  # drafts were really proposed and verified


def test_weight_bytes_within_10_percent_of_the_checkpoint(fp8_engine, fp8_checkpoint):
    """Each package's stored weights against the checkpoint bytes of the tensors it holds (the main graph: all but
    the MTP layer; the draft graph: the MTP layer, the embedding and the LM head; the commit graph holds a subset of
    the draft's). Printed for the record (pytest -s)."""
    ckpt = _checkpoint_bytes(fp8_checkpoint)
    mtp = f"model.layers.{CFG.num_hidden_layers}."
    shared = ("model.embed_tokens.weight", "lm_head.weight")
    main_ckpt = sum(v for k, v in ckpt.items() if not k.startswith(mtp))
    draft_ckpt = sum(v for k, v in ckpt.items() if k.startswith(mtp) or k in shared)
    graphs = load_engine_config(fp8_engine).build["compiled"]["graphs"]
    ratios = {"main": graphs["main"]["weight_bytes"] / main_ckpt,
              "mtp_draft": graphs["mtp_draft"]["weight_bytes"] / draft_ckpt}  # fmt: skip
    files = {g: (fp8_engine / "rank0" / f"{g}.aoti.pt2").stat().st_size for g in GRAPHS}
    print(json.dumps({"checkpoint_bytes": sum(ckpt.values()), "ratios": ratios, "package_file_bytes": files,
                      "weight_bytes": {g: graphs[g]["weight_bytes"] for g in GRAPHS}}))  # fmt: skip
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
    assert graphs["mtp_commit"]["weight_bytes"] < graphs["mtp_draft"]["weight_bytes"]


def test_engine_weights_on_disk_are_the_checkpoint_once(fp8_engine, fp8_checkpoint):
    """The issue's bound: the whole engine directory's weight bytes within 10% of the checkpoint's. Those are each
    rank's weight store (models/engine_format/weight_store.py: the weights of all its packages, each once, though
    the embedding and LM head serve main and draft, the commit graph a subset of the draft's and the fused draft
    loop all of them), any weights a package still keeps itself (data/weights/ of a .pt2: none here) and every ONNX
    weights file (`*.data`: none in a compiled engine built without --keep-onnx). What is not weights: the packages'
    code, the graph protos (`.onnx`, read by --check), config, manifest and tokenizer files. Printed for the record
    (pytest -s); with a copy per package, as before the store, it was 1.71x."""
    ckpt = sum(_checkpoint_bytes(fp8_checkpoint).values())
    stores = sum(f.stat().st_size for f in fp8_engine.glob(f"rank*/{STORE_NAME}"))
    in_packages = 0
    for package in fp8_engine.glob("rank*/*.pt2"):
        with zipfile.ZipFile(package) as z:
            in_packages += sum(i.file_size for i in z.infolist() if "/data/weights/" in i.filename)
    onnx = sum(f.stat().st_size for f in fp8_engine.rglob("*.data"))
    engine = stores + in_packages + onnx
    print(json.dumps({"checkpoint_bytes": ckpt, "stores": stores, "in_packages": in_packages, "onnx_weights": onnx,
                      "ratio_to_checkpoint": engine / ckpt}))  # fmt: skip
    assert stores > 0 and engine <= 1.10 * ckpt, (stores, in_packages, onnx, ckpt)


# DeepSeek-V3's layout (MLA, q_lora, interleaved rope) with full and partial blocks; head 5's rope rows (124..131 of
# q_b_proj: 8 heads x (14 nope + 8 rope)) straddle a 128-row block, so de-interleaving them at import moves rows
# between blocks and q_b_proj must stay float (DeepSeek-V3's 128 + 64 heads never straddle); kv_b_proj feeds the
# absorbed attention, not a linear, and stays float too.
MLA = tiny_mla_config(hidden_size=160, intermediate_size=272, moe_intermediate_size=136, q_lora_rank=136,
                      kv_lora_rank=144, qk_nope_head_dim=14, qk_rope_head_dim=8, v_head_dim=12, num_attention_heads=8,
                      num_key_value_heads=8)  # fmt: skip


def test_mla_fp8_engine_decodes_like_the_dequantized_model(tmp_path):
    make_checkpoint(tmp_path / "float", MLA, seed=7)
    quantize_checkpoint_fp8(tmp_path / "float", tmp_path / "fp8")
    write_tokenizer(tmp_path / "fp8" / "tokenizer.json", MLA.vocab_size)
    out = tmp_path / "engine"
    argv = ["--checkpoint", str(tmp_path / "fp8"), "--output", str(out), "--compile", "aoti"]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0
    graphs = load_engine_config(out).build["compiled"]["graphs"]
    # per layer q_a_proj, kv_a_proj_with_mqa, o_proj + 3 MLP / shared-expert linears (q_b_proj, kv_b_proj float)
    assert [graphs[g]["fp8_linears"] for g in GRAPHS] == [12, 7, 2]
    assert [graphs[g]["fp8_experts"] for g in GRAPHS] == [1, 1, 0]
    engine = create_engine(checkpoint=tmp_path / "fp8", executor="torch", num_draft_tokens=0, block_size=4)
    want = [o.output_ids for o in engine.generate(PROMPTS, PARAMS)]
    for k in (0, 2):
        engine = create_engine(out, num_draft_tokens=k, max_prefill_chunk=6)
        assert isinstance(engine.executor, CompiledExecutor)
        assert [o.output_ids for o in engine.generate(PROMPTS, PARAMS)] == want, f"K={k}"


def test_a_missing_op_is_refused_in_one_line(fp8_engine, tmp_path):
    """An installation without the FP8 op cannot run these packages: compiled_problem names it (auto then falls
    back to onnxruntime, --executor compiled refuses)."""
    import dataclasses

    cfg = load_engine_config(fp8_engine)
    build = json.loads(json.dumps(cfg.build))
    build["compiled"]["fp8"]["ops"] = ["linear_fp8", "linear_fp8_v9"]
    problem = compiled_problem(dataclasses.replace(cfg, build=build))
    assert problem is not None and "mtp::linear_fp8_v9" in problem and len(problem.splitlines()) == 1
    assert hasattr(torch.ops.mtp, "linear_fp8") and hasattr(torch.ops.mtp, "moe_experts_fp8")


def test_ep2_ranks_keep_their_experts_fp8(fp8_ep2_engine):
    """Each rank's main package stores its 2 routed experts as released (1 byte per weight + an fp32 scale per
    128 x 128 block, gate's and up's blocked on their own), read from the package itself, and calls the FP8 exchange
    op, never the float experts; config.json counts the experts nodes per graph as the single-rank engine's does."""
    compiled = load_engine_config(fp8_ep2_engine).build["compiled"]
    assert compiled["fp8"] == {**FP8_FORMAT, "ops": ["linear_fp8", "moe_experts_fp8_exchange"]}
    assert [compiled["graphs"][g]["fp8_experts"] for g in GRAPHS] == [1, 1, 0]
    hidden, inter, blocks = CFG.hidden_size, CFG.moe_intermediate_size, lambda n: -(-n // 128)
    for rank in (0, 1):
        package = fp8_ep2_engine / f"rank{rank}" / "main.aoti.pt2"
        consts = package_constants(package)
        gate_up = consts["model.layers.1.mlp.w_gate_up"]  # the MoE layer's; its scales are constants of their own
        assert (gate_up.dtype, gate_up.shape, gate_up.nbytes) == ("float8_e4m3fn", (2, 2 * inter, hidden),
                                                                  2 * 2 * inter * hidden)  # fmt: skip
        assert (2, 2 * blocks(inter), blocks(hidden)) in {c.shape for c in consts.values() if c.dtype == "float32"}
        ops = package_ops(package)
        assert "mtp::moe_experts_fp8_exchange" in ops and "mtp::moe_experts" not in ops, ops


def test_ep2_greedy_output_equals_the_single_rank_engine(fp8_ep2_engine, fp8_engine, tmp_path):
    """Under mpirun, greedy K=2 equals K=0 of the EP2 FP8 engine, and both equal the single-rank FP8 engine
    (chunked prefill, prefix hits, late arrivals: tests/runtime/mpi_tp_worker.py)."""
    assert_ep2_equals_single_rank(fp8_ep2_engine, fp8_engine, tmp_path / "out.json")


def test_ep2_check_probes_each_rank(fp8_ep2_engine, capsys):
    """`mtp-build --check` of the EP2 FP8 engine (each rank under mpirun, against its dequantized torch shard)."""
    assert cli.main(["--check", str(fp8_ep2_engine)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "compiled packages of 2 ranks match the torch model (each rank's shard, under mpirun)" in out, out

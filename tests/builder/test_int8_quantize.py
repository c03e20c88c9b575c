"""`mtp-build --quantize int8`: the compiled engine stores its dense linears (attention q/k/v/o, the dense MLP, the
shared experts, eh_proj; not the embeddings, LM head or router) and its routed experts as weight-only int8 with
per-output-channel fp32 scales (plugins/reference.py quantize_int8) read by mtp::linear_int8 and mtp::moe_experts_int8,
at about half the bytes of their bf16 form; MTP stays
lossless on the quantized model (K=2 decodes exactly what K=0 of the same engine decodes); its logits stay close to
the float model's; `--check` probes it against the float model with the same weights quantized; and what is not
supported yet is refused in one line.

`mtp-build --quantize int4` runs the same tests on its own engine (the `engine` fixture's second parameter): the dense
linears and routed experts whose input widths are multiples of the group (32; here all but the dense MLP's down
projection, K = 272) as group-wise int4 read by mtp::linear_int4 and mtp::moe_experts_int4 (plugins/reference.py
quantize_int4), the rest of int8's weights int8.

Under expert parallelism (`--world-size 2 --ep-size 2`, the `ep2_engine` fixture of each format) every rank stores
its own 2 of the 4 routed experts in the format and calls the format's exchange op (mtp::moe_experts_int8_exchange /
_int4_exchange), and under a real mpirun decodes what the single-rank engine of the format decodes.

One compiled build of a tiny bf16 checkpoint whose dims cross the kernel's vector chunks and tiles (hidden 160, dense
MLP 272, experts 160: 128-row blocks and tiles of 4 rows with a remainder, 4 heads x 40) serves every test; the float
reference is the torch executor on the same checkpoint.
"""

from __future__ import annotations

import json
from math import prod
from pathlib import Path

import pytest
import torch

from builder import cli
from builder.compile_check import probe_inputs
from builder.graphs import WRAPPERS
from builder.options import BuildError, BuildOptions
from models.checkpoint import load_model
from models.checkpoint_export import save_hf_checkpoint, to_hf_config
from models.engine_format import load_engine_config
from models.engine_format.compiled import AOTI_KIND, INT4_FORMAT, INT8_FORMAT, load_package
from models.testing import quantize_checkpoint_fp8, random_model, tiny_config
from plugins.kv_pool import allocate_pool, pool_address
from plugins.reference import INT4_GROUP
from runtime.core.sampling import SamplingParams
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.factory import create_engine
from tests.builder.conftest import LIMITS, write_tokenizer
from tests.builder.quantized_ep import EP2_FLAGS, assert_ep2_equals_single_rank, package_constants, package_ops
from tests.runtime.engine_utils import random_prompts

# experts 160 (not 136): a width the int4 group (32) divides, so the int4 engine's routed experts are int4
CFG = tiny_config(hidden_size=160, intermediate_size=272, moe_intermediate_size=160, head_dim=40)
PROMPTS = random_prompts((5, 13, 9, 22, 3), seed=1)
PARAMS = SamplingParams(max_tokens=20)
GRAPHS = ("main", "mtp_draft", "mtp_commit")
# Relative to the largest |logit| of a row, over the probe batch's prefill rows: weight-only int8 moves each weight by
# at most half a step (max|w_row| / 254; 0.4% of the row's largest, 0.7% in norm here), which this tiny random model
# turns into logit differences of 1.5-2.6% of each row's largest logit with the dense linears int8, 2.5% with the
# routed experts int8 too (2.7% with experts 160; measured, the torch model quantized the same way gives the same); 5% leaves room and still fails a wrong scale or a transposed weight (differences of the order
# of the logits themselves).
LOGIT_TOLERANCE = 0.05
# int4's step is max|group| / 7 (a group of 32), about 12x int8's here: the same logits moved by 31% of the row's
# largest with the routed experts int8, 33% with them int4 too (measured; --check confirms the packages compute exactly the quantized model, so this is the quantization's
# error on this flat random model). 50% still fails a wrong scale or a transposed weight (of the order of 100%).
LOGIT_TOLERANCE_INT4 = 0.5


def _argv(ckpt: Path, out: Path, *extra: str) -> list[str]:
    argv = ["--checkpoint", str(ckpt), "--output", str(out), *extra]
    for k, v in LIMITS.items():  # num_draft_tokens 2
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def write_bf16_checkpoint(path: Path) -> Path:
    """CFG's random model with bf16-valued weights, as releases are (the float engine stores its matrices bf16:
    bf16_weights), with a tokenizer; written to `path`."""
    model = random_model(CFG, seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    save_hf_checkpoint(model, to_hf_config(CFG), path)
    write_tokenizer(path / "tokenizer.json", CFG.vocab_size)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The bf16-valued checkpoint: the int8 engine's bytes compare with what the float engine would store."""
    return write_bf16_checkpoint(tmp_path_factory.mktemp("int8ckpt") / "float")


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantize(request) -> str:
    """`--quantize int8`, then `--quantize int4` (one at a time: pytest groups a module's tests by the parameter of a
    module-scoped fixture)."""
    return request.param


def _quantize_argv(quantize: str) -> list[str]:
    group = ["--int4-group-size", str(INT4_GROUP)] if quantize == "int4" else []  # 32: hidden 160 is not 64s
    return ["--compile", "aoti", "--quantize", quantize, *group]


@pytest.fixture(scope="module")
def int8_engine(quantize, checkpoint, tmp_path_factory) -> Path:
    """The single-rank engine of `--quantize int8`, then of `--quantize int4`."""
    out = tmp_path_factory.mktemp(f"{quantize}_engine") / "engine"
    assert cli.main(_argv(checkpoint, out, *_quantize_argv(quantize))) == 0
    return out


@pytest.fixture(scope="module")
def ep2_engine(quantize, checkpoint, tmp_path_factory) -> Path:
    """The same format's EP2 build of the same checkpoint: rank r holds routed experts 2r..2r+1 of 4."""
    out = tmp_path_factory.mktemp(f"{quantize}_ep2_engine") / "engine"
    assert cli.main(_argv(checkpoint, out, *_quantize_argv(quantize), *EP2_FLAGS)) == 0
    return out


def _int4_built(engine: Path) -> bool:
    return "int4" in load_engine_config(engine).build["compiled"]


def _float_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The float model's weights by the model's names (what build.compiled.int8.weights lists)."""
    return load_model(ckpt)[0].state_dict()


def test_the_dense_linears_and_routed_experts_are_int8(int8_engine, checkpoint):
    """Exactly the dense linears' and the routed experts' weights are int8 (the same ones as an FP8 release's:
    test_fp8_native.py's counts), config.json records the format, the ops and the weights, and the embeddings, LM head
    and router stay float."""
    compiled = load_engine_config(int8_engine).build["compiled"]
    int8 = compiled["int8"]
    assert {k: int8[k] for k in INT8_FORMAT} == INT8_FORMAT
    graphs = compiled["graphs"]
    assert "fp8" not in compiled
    # q/k/v/o, gate/up/down (dense MLP and shared experts) and eh_proj, of the main layers and the MTP layer; the
    # routed experts' w_gate_up and w_down of the main MoE layer and the MTP layer
    weights = _float_weights(checkpoint)
    linears = {n for n in weights if n.endswith("_proj.weight")}
    experts = {n for n in weights if n.endswith((".mlp.w_gate_up", ".mlp.w_down"))}
    assert len(linears) == 14 + 8 and len(experts) == 4 and all(weights[n].dim() == 3 for n in experts)
    if not _int4_built(int8_engine):
        assert int8["ops"] == ["linear_int8", "moe_experts_int8"]
        assert [graphs[g]["int8_experts"] for g in GRAPHS] == [1, 1, 0]  # the MoE layer's, the MTP layer's; none
        assert [graphs[g]["int8_linears"] for g in GRAPHS] == [14, 8, 3]
        assert [graphs[g]["int8_weights"] for g in GRAPHS] == [14 + 2, 8 + 2, 3]
        assert sorted(linears | experts) == int8["weights"]
        return
    # int4: every linear whose K (input width) is a multiple of 32 and the routed experts (H = I = 160); the dense MLP's
    # down projection (K = 272) int8
    int4 = compiled["int4"]
    assert {k: int4[k] for k in INT4_FORMAT} == INT4_FORMAT and int4["ops"] == ["linear_int4", "moe_experts_int4"]
    assert int4["group_size"] == INT4_GROUP
    down = {n for n in linears if weights[n].shape[1] == 272}
    assert len(down) == 1 and not any(weights[n].shape[-1] % 32 for n in (linears | experts) - down)
    assert int4["weights"] == sorted((linears | experts) - down) and int8["weights"] == sorted(down)
    assert [graphs[g]["int4_experts"] for g in GRAPHS] == [1, 1, 0]  # the MoE layer's, the MTP layer's; none
    assert [graphs[g]["int8_experts"] for g in GRAPHS] == [0, 0, 0] and int8["ops"] == ["linear_int8"]
    assert [graphs[g]["int4_linears"] + graphs[g]["int8_linears"] for g in GRAPHS] == [14, 8, 3]
    assert [graphs[g]["int8_linears"] for g in GRAPHS] == [1, 0, 0]  # the dense layer's down projection
    assert [graphs[g]["int4_weights"] + graphs[g]["int8_weights"] for g in GRAPHS] == [14 + 2, 8 + 2, 3]


def test_package_bytes_are_about_half_the_bf16_weights(int8_engine, checkpoint):
    """The main package's stored weights: what a float engine stores of what it holds (bf16 for the checkpoint's bf16
    matrices, compile_aoti.bf16_weights; fp32 for the rest: norms, the router's bias), less what int8 saves on each
    quantized linear and expert matrix (1 byte per weight + 4 per row instead of 2 per weight): within 10%, and
    clearly below the float engine's. Printed for the record (pytest -s)."""
    weights = _float_weights(checkpoint)
    names = load_engine_config(int8_engine).build["compiled"]["int8"]["weights"]
    assert all(torch.equal(weights[n].bfloat16().float(), weights[n]) for n in names)
    bf16 = {n: (2 if w.dim() >= 2 and torch.equal(w.bfloat16().float(), w) else 4) * w.numel()
            for n, w in weights.items()}  # fmt: skip
    int8 = {n: weights[n].numel() + 4 * (weights[n].numel() // weights[n].shape[-1]) for n in names}  # + a scale a row
    int4_names = load_engine_config(int8_engine).build["compiled"].get("int4", {}).get("weights", [])
    assert all(torch.equal(weights[n].bfloat16().float(), weights[n]) for n in int4_names)
    # int4: half a byte per weight + 4 bytes per 32 of a row
    int8.update({n: weights[n].numel() // 2 + 4 * (weights[n].numel() // INT4_GROUP) for n in int4_names})
    names = names + int4_names
    main = [n for n in weights if not n.startswith("mtp.")]  # the main graph: all but the MTP layer
    bf16_main = sum(bf16[n] for n in main)
    want_main = bf16_main - sum(bf16[n] - int8[n] for n in names if n in main)
    got = load_engine_config(int8_engine).build["compiled"]["graphs"]["main"]["weight_bytes"]
    linears_ratio = sum(int8.values()) / sum(bf16[n] for n in names)
    print(json.dumps({"main_weight_bytes": got, "want": want_main, "bf16_main": bf16_main,
                      "int8_weights_over_bf16": linears_ratio}))  # fmt: skip
    # int4 holds all the quantized weights but the dense down projection (4% of them), the routed experts included:
    # 0.3125 of bf16 for those (0.32 in all, by the shapes)
    assert (0.31 <= linears_ratio <= 0.33) if int4_names else (0.5 <= linears_ratio <= 0.52)
    assert 0.9 <= got / want_main <= 1.1 and got < 0.7 * bf16_main


@pytest.mark.parametrize("k", [2])
def test_mtp_stays_lossless_on_the_quantized_model(int8_engine, k):
    """Greedy K=2 on the int8 engine decodes exactly what K=0 of the same engine decodes (drafts really verified)."""
    base = create_engine(int8_engine, num_draft_tokens=0, max_prefill_chunk=6)
    assert isinstance(base.executor, CompiledExecutor)
    want = [o.output_ids for o in base.generate(PROMPTS, PARAMS)]
    engine = create_engine(int8_engine, num_draft_tokens=k, max_prefill_chunk=6)
    outs = engine.generate(PROMPTS, PARAMS)
    engine.kv.assert_no_leaks()
    assert [o.output_ids for o in outs] == want
    # int4's draft head on this flat random model agrees with its main model on no draft (0 of 190, measured): the
    # equality above still holds, and the int8 engine's run checks that accepted drafts are verified
    if not _int4_built(int8_engine):
        assert engine.metrics.mean_acceptance_length > 1.0


def test_logits_stay_close_to_the_float_model(int8_engine, checkpoint):
    """The main package's logits on the probe batch's prefill request against the unquantized torch model's
    (LOGIT_TOLERANCE of each row's largest |logit|). Its verify rows attend to pool slots no step wrote, where this
    random model amplifies any change (17-36% there for the torch model quantized the same way: not the kernels,
    which --check compares at 1e-4), so they are left out. Greedy agreement with the float model over whole
    generations is printed for the record."""
    cfg = load_engine_config(int8_engine)
    inputs = probe_inputs(cfg)["main"]
    prefill = int(inputs[2][0])  # q_counts: the prefill request's rows come first
    geom = cfg.kv.geometry()
    package = load_package(cfg, cfg.graph_file(0, "main", AOTI_KIND))
    model = load_model(checkpoint)[0].eval().fuse()
    with torch.inference_mode():
        _, got = package(*inputs, pool_address(allocate_pool(geom)))
        _, want = WRAPPERS["main"](model, geom)(*inputs, pool_address(allocate_pool(geom)))
    got, want = got[:prefill], want[:prefill]
    rel = float(((got - want).abs().amax(1) / want.abs().amax(1)).max())
    float_engine = create_engine(checkpoint=checkpoint, executor="torch", num_draft_tokens=0, block_size=4)
    ref = [o.output_ids for o in float_engine.generate(PROMPTS, PARAMS)]
    ours = [o.output_ids for o in create_engine(int8_engine, num_draft_tokens=2).generate(PROMPTS, PARAMS)]
    same = sum(a == b for r, o in zip(ref, ours, strict=True) for a, b in zip(r, o, strict=True))
    first = [
        next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
        for r, o in zip(ref, ours, strict=True)
    ]
    print(json.dumps({"max_logit_diff_over_max_logit": rel, "greedy_tokens_equal": same,
                      "tokens": sum(len(r) for r in ref), "first_divergence_per_prompt": first}))  # fmt: skip
    assert 0 < rel <= (LOGIT_TOLERANCE_INT4 if _int4_built(int8_engine) else LOGIT_TOLERANCE)  # > 0: quantized


def test_check_probes_against_the_quantized_float_model(int8_engine, capsys):
    """`mtp-build --check` quantizes the recorded weights of the torch model the same way: the packages match it
    at the float tolerance (a probe against the unquantized model would fail it)."""
    assert cli.main(["--check", str(int8_engine)]) == 0
    assert "compiled packages match the torch model on a probe batch" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("extra,match", [
    (["--compile", "none"], "--quantize int8 with --compile none is not supported yet"),
])  # fmt: skip
def test_unsupported_combinations_are_refused_in_one_line(checkpoint, tmp_path, capsys, extra, match):
    assert cli.main(_argv(checkpoint, tmp_path / "engine", "--quantize", "int8", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert match in " ".join(err.split()) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "engine").exists()


def test_a_model_without_a_compiled_engine_is_refused():
    """--compile auto resolves to none for --backend tensorrt: no int8 reader there."""
    opts = BuildOptions(checkpoint=Path("c"), output=Path("o"), backend="tensorrt", dtype="float16", quantize="int8",
                        **LIMITS)  # fmt: skip
    opts.validate()
    with pytest.raises(BuildError, match="--quantize int8 without the compiled engine is not supported yet") as e:
        opts.validate_for_model(CFG)
    assert len(str(e.value).splitlines()) == 1


def test_an_fp8_checkpoint_is_refused_in_one_line(checkpoint, tmp_path, capsys):
    quantize_checkpoint_fp8(checkpoint, tmp_path / "fp8")
    assert cli.main(_argv(tmp_path / "fp8", tmp_path / "engine", "--compile", "aoti", "--quantize", "int8")) == 2
    err = capsys.readouterr().err.strip()
    assert "--quantize int8 with an FP8 checkpoint is not supported yet" in " ".join(err.split()), err
    assert len(err.splitlines()) == 1


def test_ep2_ranks_store_their_experts_in_the_format(ep2_engine, int8_engine, quantize):
    """Each rank's main package stores its 2 routed experts in the format (int8: 1 byte per weight + an fp32 scale
    per row; int4: packed, half a byte per weight + an fp32 scale per 32 of a row; float experts: bf16, 2 bytes), read
    from the package itself, and calls the format's exchange op, never the float experts; config.json counts the
    experts nodes per graph as the single-rank engine's does and names the same weights."""
    compiled, single = (load_engine_config(e).build["compiled"] for e in (ep2_engine, int8_engine))
    graphs = compiled["graphs"]
    assert [graphs[g][f"{quantize}_experts"] for g in GRAPHS] == [1, 1, 0]  # the MoE layer's, the MTP layer's; none
    assert compiled[quantize]["ops"] == [f"linear_{quantize}", f"moe_experts_{quantize}_exchange"]
    assert compiled[quantize]["weights"] == single[quantize]["weights"]
    hidden, inter, e = CFG.hidden_size, CFG.moe_intermediate_size, 2  # e: the experts a rank holds
    # (stored dtype, stored shapes of w_gate_up and w_down, their scales' shapes: the scales are constants of their own)
    want = {"int8": ("int8", (e, 2 * inter, hidden), (e, hidden, inter), {(e, 2 * inter), (e, hidden)}),
            "int4": ("uint8", (e, 2 * inter, hidden // 2), (e, hidden, inter // 2),
                     {(e, 2 * inter, hidden // INT4_GROUP), (e, hidden, inter // INT4_GROUP)})}[quantize]  # fmt: skip
    for rank in (0, 1):
        package = ep2_engine / f"rank{rank}" / "main.aoti.pt2"
        consts = package_constants(package)
        gate_up, down = consts["model.layers.1.mlp.w_gate_up"], consts["model.layers.1.mlp.w_down"]  # the MoE layer
        assert (gate_up.dtype, gate_up.shape, down.dtype, down.shape) == (want[0], want[1], want[0], want[2])
        assert (gate_up.nbytes, down.nbytes) == (prod(want[1]), prod(want[2]))  # int8: 1 byte a weight; int4: 1/2
        assert want[3] <= {c.shape for c in consts.values() if c.dtype == "float32"}
        ops = package_ops(package)
        assert f"mtp::moe_experts_{quantize}_exchange" in ops and "mtp::moe_experts" not in ops, ops


def test_ep2_greedy_output_equals_the_single_rank_engine(ep2_engine, int8_engine, tmp_path):
    """Under mpirun, greedy K=2 equals K=0 of the EP2 engine, and both equal the single-rank engine of the same
    format (chunked prefill, prefix hits, late arrivals: tests/runtime/mpi_tp_worker.py)."""
    assert_ep2_equals_single_rank(ep2_engine, int8_engine, tmp_path / "out.json")


def test_ep2_check_probes_each_rank_against_the_quantized_shard(ep2_engine, capsys):
    """`mtp-build --check` of the EP2 engine (each rank under mpirun, against its torch shard quantized as built)."""
    assert cli.main(["--check", str(ep2_engine)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "compiled packages of 2 ranks match the torch model (each rank's shard, under mpirun)" in out, out

"""The choices beside `--quantize` (test_int8_quantize.py has the formats themselves).

`mtp-build --quantize int8 --quantize-mtp none --quantize-lm-head`: the trunk's graph (`main`) is quantized, its LM
head too, while the MTP module's graphs (`mtp_draft`, `mtp_commit`) keep the checkpoint's precision, the LM head the
draft graph shares with the trunk included; config.json says which graphs were quantized; `--check` probes each
package against the torch model as that package was built (the shared LM head int8 for `main`, float for
`mtp_draft`); MTP stays lossless. Peers lose acceptance by quantizing the MTP head (issue 26): this keeps it float.

One compiled build of test_int8_quantize.py's tiny bf16 checkpoint geometry (the default `--quantize-mtp same`, the
LM head float, is that file's engine).

`--int4-group-size G`: the int4 rewrite with another group, on an exported linear (no engine build): the weight is
stored with K / G scales per row, the op is called with G, and the program computes the reference's dequantized
product; what G may be is one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from builder import cli
from builder.compile_check import as_built
from builder.options import BuildError, BuildOptions
from builder.quantized_weights import int4_weights
from models.checkpoint import load_model
from models.engine_format import load_engine_config
from plugins.reference import dequantize_int4_ref, quantize_int4
from runtime.bench.quant_quality import perplexity
from runtime.factory import create_engine
from tests.builder.conftest import LIMITS
from tests.builder.test_int8_quantize import PARAMS, PROMPTS, _argv, write_bf16_checkpoint
from tests.runtime.engine_utils import random_prompts

GRAPHS = ("main", "mtp_draft", "mtp_commit")


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("quantize_mtp")
    write_bf16_checkpoint(root / "ckpt")
    out = root / "engine"
    assert (
        cli.main(
            _argv(
                root / "ckpt",
                out,
                "--compile",
                "aoti",
                "--quantize",
                "int8",
                "--quantize-mtp",
                "none",
                "--quantize-lm-head",
            )
        )
        == 0
    )
    return out


def test_only_the_trunk_is_quantized_with_its_lm_head(engine):
    """int8 weights only outside the MTP module (`mtp.*`), the LM head among them; the MTP graphs read none; and
    config.json names the quantized graphs. (test_int8_quantize.py: the MTP graphs read 8 + 2 and 3 int8 weights,
    the main graph 14 linears.)"""
    compiled = load_engine_config(engine).build["compiled"]
    graphs = compiled["graphs"]
    assert compiled["quantized_graphs"] == ["main"]
    assert [graphs[g].get("int8_linears", 0) for g in GRAPHS] == [14 + 1, 0, 0]  # + the LM head
    assert [graphs[g].get("int8_experts", 0) for g in GRAPHS] == [1, 0, 0]
    names = compiled["int8"]["weights"]
    assert "lm_head.weight" in names and not [n for n in names if n.startswith("mtp.")], names


def test_mtp_stays_lossless_and_the_float_head_drafts(engine):
    """K=2 decodes exactly what K=0 of the same engine decodes; the float head's drafts are accepted."""
    want = [
        o.output_ids for o in create_engine(engine, num_draft_tokens=0, max_prefill_chunk=6).generate(PROMPTS, PARAMS)
    ]
    mtp = create_engine(engine, num_draft_tokens=2, max_prefill_chunk=6)
    assert [o.output_ids for o in mtp.generate(PROMPTS, PARAMS)] == want
    mtp.kv.assert_no_leaks()
    assert mtp.metrics.mean_acceptance_length > 1.0


def test_check_probes_the_trunk_quantized_and_the_head_float(engine, capsys):
    """`--check` dequantizes exactly the recorded weights (the trunk's): the float MTP packages match the float head."""
    assert cli.main(["--check", str(engine)]) == 0
    assert "compiled packages match the torch model on a probe batch" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("kw,match", [
    ({"quantize_mtp": "none"}, "--quantize-mtp none only matters with --quantize int8 or int4"),
    ({"quantize_lm_head": True}, "--quantize-lm-head stores the LM head int8 beside --quantize int8 or int4"),
    ({"int4_group_size": 32, "quantize": "int8"}, "--int4-group-size 32 only applies to --quantize int4"),
    ({"int4_group_size": 33, "quantize": "int4"}, "--int4-group-size 33: must be a positive even number"),
    ({"int4_group_size": 0, "quantize": "int4"}, "--int4-group-size 0: must be a positive even number"),
])  # fmt: skip
def test_bad_combinations_are_refused_in_one_line(kw, match):
    opts = BuildOptions(checkpoint=Path("c"), output=Path("o"), **LIMITS, **kw)
    with pytest.raises(BuildError, match=match) as e:
        opts.validate()
    assert len(str(e.value).splitlines()) == 1


def test_perplexity_is_the_built_models_own(engine):
    """quant_quality's perplexity (one prefill forward per text on the compiled engine, every row's logits) equals
    the torch model's as built (the trunk and its LM head int8: compile_check.as_built), teacher-forced over whole
    sequences with forward_train."""
    cfg = load_engine_config(engine)
    texts = random_prompts((29, 12), seed=3)
    got = perplexity(engine, texts)
    model = as_built(cfg, load_model(Path(cfg.checkpoint["path"]))[0]).eval()
    nll = count = 0.0
    with torch.inference_mode():
        for ids in texts:
            logits = model.forward_train(torch.tensor([ids]))[0][0, :-1].double()
            nll -= float(torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum())
            count += len(ids) - 1
    want = float(torch.tensor(nll / count).exp())
    assert abs(got - want) <= 1e-4 * want, (got, want)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_group_size_reaches_the_stored_weight_and_the_op(group):
    """An exported fp32 linear (K = 256, N = 24) through int4_weights(group=G): scales [N, K / G], the rewritten node
    calls mtp::linear_int4 with G, and the program's output equals x @ dequantize_int4_ref(...)^T + b."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 24)
    x = torch.randn(3, 256)
    program = torch.export.export(torch.nn.Sequential(lin), (x,))
    stats = int4_weights(program, prefix="", group=group)
    assert stats["int4_linears"] == 1 and stats["int4_names"] == ["0.weight"]
    node = next(n for n in program.graph_module.graph.nodes if n.target is torch.ops.mtp.linear_int4.default)
    assert node.args[3] == group
    packed, scale = quantize_int4(lin.weight.detach(), group)
    assert scale.shape == (24, 256 // group)
    want = x @ dequantize_int4_ref(packed, scale, group).T + lin.bias.detach()
    torch.testing.assert_close(program.module()(x), want, rtol=1e-5, atol=1e-5)

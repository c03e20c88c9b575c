"""DeepSeek Sparse Attention checkpoints (GLM-5 `glm_moe_dsa`, the parity tests' size, index_topk 8) through
`mtp-build`: config.json records the indexer fields and counts the indexer-key planes in kv.num_planes, the graphs
hold the DSA plugin nodes (DsaIndexTopk per layer with its own indexer, DsaSparseAttention per attention layer, the
commit pass writing the MTP layer's keys), `--check` passes and refuses a pool without the key planes in one line,
and both engines (ONNX Runtime, compiled) decode greedy token-identical to the torch executor at K=0 and K=2 with
prefill chunks shorter than the prompts (contexts cross index_topk: the sparse path runs) and a prefix hit.

The checkpoint is the FP8 release format (GLM-5-FP8 / DeepSeek-V3.2 ship FP8: models.testing.quantize_checkpoint_fp8,
the indexer's wq_b and wk included), so the one `--compile aoti --keep-onnx` build (both executors) (~3 min here: the ONNX graphs, which hold
the dequantized weights, and the AOTInductor packages) also shows the packages keeping its FP8 linears FP8
(builder/quantized_weights.py) at about the checkpoint's bytes, against the torch executor on the same checkpoint,
which dequantizes at load. DeepSeek-V3.2 was checked by hand (docs/MODELS.md "DSA engines")."""

from __future__ import annotations

import collections
import json

import onnx
import pytest
from safetensors import safe_open

from builder import cli
from models.engine_format import KVLayout, load_engine_config
from models.engine_format.compiled import FP8_FORMAT
from models.engine_format.crosscheck import node_mismatch
from models.testing import quantize_checkpoint_fp8
from models.testing_dsa import DSA_VARIANTS, make_dsa_checkpoint
from plugins.names import DSA_INDEX_TOPK, DSA_SPARSE_ATTENTION, MLA_KV_WRITE
from runtime.core.sampling import SamplingParams
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.factory import create_engine
from tests.builder.engine_edits import copy_engine, edit_config
from tests.builder.test_fp8_native import GRAPHS, _checkpoint_bytes
from tests.runtime.engine_utils import random_prompts

pytest.importorskip("transformers")

VOCAB = 6  # a random MTP module agrees with the main model ~1/vocab of the time: accepted AND rejected drafts
LIMITS = dict(max_batch=4, max_num_tokens=32, max_seq_len=64, kv_block_size=4, num_draft_tokens=2)
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=VOCAB, seed=0)  # 22 + 12 generated: past index_topk 8
PARAMS = SamplingParams(max_tokens=12)


# 16 routed experts of 64: the experts outweigh the absorbed kv_b_proj, which the packages keep float32 (4x its FP8
# bytes; bmm, not a linear, reads it), as in the releases (GLM-5: ~0.5% of the weights), not 20% as at the parity size
SIZE = dict(vocab_size=VOCAB, n_routed_experts=16, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    model_type, overrides = DSA_VARIANTS["glm5"]  # layers F, S, F: a shared layer reuses layer 0's top-k
    make_dsa_checkpoint(root / "float", model_type, seed=6, **{**overrides, **SIZE})
    quantize_checkpoint_fp8(root / "float", root / "ckpt")
    argv = ["--checkpoint", str(root / "ckpt"), "--output", str(root / "engine"), "--compile", "aoti", "--keep-onnx"]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0  # ids-only (no tokenizer.json): requests are token ids
    return root / "ckpt", root / "engine"


def _nodes(engine, name: str) -> collections.Counter:
    g = onnx.load(str(load_engine_config(engine).graph_file(0, name)), load_external_data=False).graph
    return collections.Counter(n.op_type for n in g.node if n.domain == "mtp")


def test_config_records_the_indexer_and_graphs_hold_the_dsa_nodes(dsa):
    ckpt, engine = dsa
    cfg = load_engine_config(engine)
    model = json.loads((engine / "config.json").read_text())["model"]
    assert (model["index_topk"], model["index_n_heads"], model["index_head_dim"]) == (8, 8, 12)
    assert model["index_pattern"] == "FSF" == cfg.model.index_pattern
    assert cfg.kv.num_planes == 2 * (3 + 1) and cfg.kv.kv_kind == 1  # latent planes, then as many indexer-key planes
    assert {DSA_INDEX_TOPK, DSA_SPARSE_ATTENTION} <= set(cfg.plugins["nodes"])
    main = _nodes(engine, "main")  # two layers with an indexer, three attending; latent + key writes of F layers
    assert (main[DSA_INDEX_TOPK], main[DSA_SPARSE_ATTENTION], main[MLA_KV_WRITE]) == (2, 3, 5)
    assert "MlaPagedAttention" not in main  # a graph cannot branch on the lengths: always the sparse ops
    draft = _nodes(engine, "mtp_draft")  # the MTP layer scores its own keys
    assert (draft[DSA_INDEX_TOPK], draft[DSA_SPARSE_ATTENTION], draft[MLA_KV_WRITE]) == (1, 1, 2)
    assert _nodes(engine, "mtp_commit") == {MLA_KV_WRITE: 2}  # its latent rows and its indexer keys
    assert cli.main(["--check", str(engine)]) == 0


def test_check_refuses_a_pool_without_the_indexer_planes_in_one_line(dsa, tmp_path, capsys):
    copy = copy_engine(dsa[1], tmp_path)
    edit_config(copy, kv__num_planes=4)
    capsys.readouterr()
    assert cli.main(["--check", str(copy)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv.num_planes" in err[0], err


def test_a_dsa_node_with_another_row_width_is_named():
    kv = KVLayout(num_planes=8, num_blocks=10, block_size=4, num_kv_heads=1, head_dim=40, dtype_code=0,
                  table_width=16, kv_kind=1)  # fmt: skip
    attrs = dict(plane=5, num_planes=8, num_blocks=10, block_size=4, dtype=0, topk=8, scale=0.5)
    node = onnx.helper.make_node(DSA_INDEX_TOPK, ["q"], ["s"], domain="mtp", row_dim=40, **attrs)
    assert node_mismatch(kv, {}, node) is None
    node = onnx.helper.make_node(DSA_INDEX_TOPK, ["q"], ["s"], domain="mtp", row_dim=24, **attrs)
    assert node_mismatch(kv, {}, node) == "DsaIndexTopk node was built with row_dim=24 but config.json gives kv.head_dim=40"
    gqa = KVLayout(num_planes=8, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=40, dtype_code=0,
                   table_width=16, kv_kind=0)  # fmt: skip
    assert "a GQA K/V pool" in node_mismatch(gqa, {}, node)


def test_engines_are_lossless_against_the_torch_executor(dsa):
    ckpt, engine = dsa
    ref = create_engine(checkpoint=ckpt, executor="torch", num_draft_tokens=0, block_size=4, num_blocks=200,
                        max_batch=4, max_num_tokens=32, max_seq_len=64)  # fmt: skip
    want = [o.output_ids for o in ref.generate(PROMPTS, PARAMS)]
    assert len(set(map(tuple, want))) > 1
    for executor, k in [("onnxruntime", 0), ("onnxruntime", 2), ("compiled", 0), ("compiled", 2)]:
        eng = create_engine(engine_dir=engine, executor=executor, num_draft_tokens=k, max_prefill_chunk=6)
        assert isinstance(eng.executor, CompiledExecutor) == (executor == "compiled")
        got = [o.output_ids for o in eng.generate(PROMPTS, PARAMS)]
        assert got == want, f"{executor} K={k}"
        again = [o.output_ids for o in eng.generate([PROMPTS[3]], PARAMS)]  # 22 prompt tokens: 5 blocks cached
        assert again == [want[3]] and eng.metrics.prefix_hit_tokens >= 20, f"{executor} K={k}"
        eng.kv.assert_no_leaks()
        if k:
            rate = eng.metrics.acceptance_rate_per_position[0]
            assert 0 < rate < 1, f"{executor} K={k}: acceptance {rate}: accepted and rejected drafts must both occur"


def test_fp8_linears_stay_fp8_in_the_packages(dsa):
    """Every linear whose release weight is FP8 reads it as FP8: per layer q_a_proj, q_b_proj, kv_a_proj_with_mqa and
    o_proj, the indexer's wq_b and wk (layers 0 and 2; layer 1 shares their top-k), the dense MLP, the shared experts
    and eh_proj; the routed experts too (kv_b_proj feeds the absorbed attention and stays float, as do the indexer's
    weights_proj, float in the releases, and the norms, router, embedding and head)."""
    ckpt, engine = dsa
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    for layer in (0, 2, 3):  # 3: the MTP layer's own indexer
        indexer = f"model.layers.{layer}.self_attn.indexer."
        assert (dtypes[indexer + "wq_b.weight"], dtypes[indexer + "wk.weight"]) == ("F8_E4M3", "F8_E4M3")
        assert dtypes[indexer + "weights_proj.weight"] == "F32"
    compiled = load_engine_config(engine).build["compiled"]
    assert compiled["fp8"] == {**FP8_FORMAT, "ops": ["linear_fp8", "moe_experts_fp8"]}
    graphs = compiled["graphs"]
    # main: 3 x 4 attention + 2 x 2 indexer + 3 dense MLP + 2 x 3 shared expert; draft: eh_proj + 4 + 2 + 3 shared;
    # commit: eh_proj, kv_a_proj_with_mqa and the indexer's wk (the rows it writes)
    assert [graphs[g]["fp8_linears"] for g in GRAPHS] == [25, 10, 3]
    assert [graphs[g]["fp8_experts"] for g in GRAPHS] == [2, 1, 0]
    assert [graphs[g]["fp8_weights"] for g in GRAPHS] == [29, 12, 3]  # + w_gate_up and w_down per experts node


def test_package_weight_bytes_within_10_percent_of_the_checkpoint(dsa):
    """As tests/builder/test_fp8_native.py: the main package against the checkpoint bytes of all but the MTP layer,
    the draft package against the MTP layer's, the embedding's and the head's."""
    ckpt, engine = dsa
    sizes = _checkpoint_bytes(ckpt)
    mtp, shared = "model.layers.3.", ("model.embed_tokens.weight", "lm_head.weight")
    graphs = load_engine_config(engine).build["compiled"]["graphs"]
    ratios = {"main": graphs["main"]["weight_bytes"] / sum(v for k, v in sizes.items() if not k.startswith(mtp)),
              "mtp_draft": graphs["mtp_draft"]["weight_bytes"]
              / sum(v for k, v in sizes.items() if k.startswith(mtp) or k in shared)}  # fmt: skip
    print(json.dumps({"ratios": ratios}))
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios

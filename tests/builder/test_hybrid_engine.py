"""Hybrid Gated-DeltaNet checkpoints (Qwen3-Next, Qwen3.5-MoE) through `mtp-build`: the engine records its state pool
(config.json `state`), `--check` passes, the main graph holds one GdnStep node per GDN layer while the draft and
commit graphs take no state at all (the MTP layer is full attention), and the ONNX Runtime engine and (qwen3_next,
built with mtp-build's default `--compile auto`) the compiled engine decode greedy token-identical to the torch
executor at K=0..3 with prefill chunks shorter than the prompts, prefix hits (one resuming from a snapshot stored
inside a prefill chunk, every 8 tokens) and a state pool poisoned with NaN (a
slot is only read after its request wrote it); the compiled engine is then the default executor. A `state` that
disagrees with the model is refused with one line."""

from __future__ import annotations

import json

import onnx
import pytest

from builder import cli
from models.engine_format import EngineDirError, load_engine_config
from models.engine_format.compiled import compiled_info
from models.testing import make_hybrid_checkpoint
from plugins.names import GDN_STEP
from runtime.core.sampling import SamplingParams
from runtime.executors.compiled_executor import CompiledExecutor
from runtime.executors.ort_executor import OrtExecutor
from runtime.factory import create_engine
from tests.builder.engine_edits import copy_engine, edit_config
from tests.runtime.engine_utils import random_prompts

pytest.importorskip("transformers")

VOCAB = 6  # a random MTP module agrees with the main model ~1/vocab of the time: accepted AND rejected drafts
# 2 layers (one GDN, one gated attention) instead of the fixtures' 4: the ONNX export is the slow part of a build.
LAYERS = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
LIMITS = dict(max_batch=4, max_num_tokens=32, max_seq_len=64, kv_block_size=4, num_draft_tokens=3)
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=VOCAB, seed=0)
PARAMS = SamplingParams(max_tokens=12)
# shares 9 tokens with PROMPTS[3]: a hit of 8, from the snapshot every 8 tokens stores inside a prefill chunk of 6..11
BRANCH = PROMPTS[3][:9] + [(t + 1) % VOCAB for t in PROMPTS[3][9:14]]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    make_hybrid_checkpoint(root / "ckpt", request.param, seed=2, vocab_size=VOCAB, **LAYERS)
    # qwen3_next: mtp-build's default, which compiles hybrids too (one compiled model type is enough: the
    # packages' code path is the same for both), keeping the ONNX weights so that both executors run it;
    # qwen3_5_moe: the ONNX Runtime engine alone
    compile_ = ["--keep-onnx"] if request.param == "qwen3_next" else ["--compile", "none"]
    argv = ["--checkpoint", str(root / "ckpt"), "--output", str(root / "engine"), *compile_]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0  # ids-only (no tokenizer.json): requests are token ids
    return root / "ckpt", root / "engine"


def _graph(engine, name: str) -> onnx.ModelProto:
    return onnx.load(str(load_engine_config(engine).graph_file(0, name)), load_external_data=False)


def test_build_records_the_state_pool_and_graphs_need_it_only_in_main(hybrid):
    ckpt, engine = hybrid
    cfg = load_engine_config(engine)
    m, state = cfg.model, cfg.state
    assert state is not None and cfg.kv.num_planes == 1 + m.num_mtp_modules  # only attention layers own a KV plane
    assert (state.num_layers, state.slots_per_request, state.num_slots) == (1, 3 + 2, 4 * (3 + 2))
    assert (state.conv_dim, state.conv_kernel, state.dtype_code) == (m.gdn_conv_dim, m.linear_conv_kernel_dim, 0)
    assert json.loads((engine / "config.json").read_text())["state"]["num_slots"] == 20
    assert cli.main(["--check", str(engine)]) == 0
    main = _graph(engine, "main")
    gdn = [n for n in main.graph.node if n.op_type == GDN_STEP]
    assert [next(a.i for a in n.attribute if a.name == "layer") for n in gdn] == [0]
    assert {"state_read_slots", "state_write_slots", "conv_pool_ptr", "ssm_pool_ptr"} <= {i.name for i in main.graph.input}
    for name in ("mtp_draft", "mtp_commit"):  # the MTP layer is full attention: no recurrent state
        g = _graph(engine, name).graph
        assert not [n for n in g.node if n.op_type == GDN_STEP]
        assert not {i.name for i in g.input} & {"state_read_slots", "conv_pool_ptr", "ssm_pool_ptr"}


def test_the_default_executor_is_the_compiled_one_where_built(hybrid):
    ckpt, engine = hybrid
    compiled = compiled_info(load_engine_config(engine))
    executor = create_engine(engine_dir=engine, num_draft_tokens=0).executor
    if compiled is None:  # qwen3_5_moe, built with --compile none
        assert isinstance(executor, OrtExecutor)
        return
    assert isinstance(executor, CompiledExecutor) and set(compiled["graphs"]) == {"main", "mtp_draft", "mtp_commit",
                                                                                "mtp_draft_fused"}  # fmt: skip
    # the packages bake the state pool: the request slots (20) plus the default snapshots, 4 per request of max_batch
    assert compiled["state_slots"] == 20 + 4 * 4 and executor.state is not None and executor.state.num_slots == 36


def _executors(engine) -> list[str]:
    return ["onnxruntime"] + (["compiled"] if compiled_info(load_engine_config(engine)) else [])


def test_engines_are_lossless_against_the_torch_executor(hybrid):
    ckpt, engine = hybrid
    ref = create_engine(checkpoint=ckpt, executor="torch", num_draft_tokens=0, block_size=4, num_blocks=200,
                        max_batch=4, max_num_tokens=32, max_seq_len=64)  # fmt: skip
    want = [o.output_ids for o in ref.generate(PROMPTS, PARAMS)]
    want_branch = [o.output_ids for o in ref.generate([BRANCH], PARAMS)]
    assert len(set(map(tuple, want))) > 1
    for executor, k in [(e, k) for e in _executors(engine) for k in (0, 1, 2, 3)]:
        eng = create_engine(engine_dir=engine, executor=executor, num_draft_tokens=k, max_prefill_chunk=6,
                            state_snapshot_interval=8)  # fmt: skip
        eng.executor.state.conv.fill_(float("nan"))  # every state slot poisoned: read only after written
        eng.executor.state.ssm.fill_(float("nan"))
        got = [o.output_ids for o in eng.generate(PROMPTS, PARAMS)]
        assert got == want, f"{executor} K={k}"
        if k == 2:  # prefix hits: the state pool has the snapshot slots (ORT: GdnStep's num_slots rewritten in memory)
            assert eng.executor.state.num_slots == 20 + eng.cfg.num_state_snapshots > 20
            again = [o.output_ids for o in eng.generate([PROMPTS[3], PROMPTS[1]], PARAMS)]
            assert again == [want[3], want[1]] and eng.metrics.prefix_hit_tokens >= 20 + 12
            branch = next(iter(eng.generate([BRANCH], PARAMS)))
            assert [branch.output_ids] == want_branch and branch.num_cached_tokens == 8, f"{executor}: interval hit"
            eng.state_slots.snapshots.assert_no_leaks()
        eng.kv.assert_no_leaks()
        assert eng.state_slots.num_free_groups == eng.cfg.max_batch
        if k:
            rate = eng.metrics.acceptance_rate_per_position[0]
            assert 0 < rate < 1, f"{executor} K={k}: acceptance {rate}: accepted and rejected drafts must both occur"


def test_a_state_pool_that_disagrees_is_refused_with_one_line(hybrid, tmp_path):
    ckpt, engine = hybrid
    copy = copy_engine(engine, tmp_path)
    edit_config(copy, state__num_slots=8)
    with pytest.raises(EngineDirError, match=r"state\.num_slots=8 but the model, limits and num_draft_tokens give 20"):
        load_engine_config(copy)
    raw = json.loads((copy / "config.json").read_text())
    del raw["state"]
    (copy / "config.json").write_text(json.dumps(raw))
    edit_config(copy)  # re-seal
    with pytest.raises(EngineDirError, match="has Gated DeltaNet layers but config.json records no `state` pool") as e:
        load_engine_config(copy)
    assert "\n" not in str(e.value)

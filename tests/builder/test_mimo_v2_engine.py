"""MiMo-V2-Flash engines (issue 29): `mtp-build` writes one draft graph per MTP module (`mtp_draft`, `mtp_draft_1`,
`mtp_draft_2`; models/engine_format/graph_io.py draft_graphs), config.json lists them, `--check` passes, and the
executors run module d's graph at depth d: greedy output == the torch executor at K=0 and K=3 with prefill chunks
shorter than the prompts and a prefix hit, with the torch executor's acceptance at every depth (module 0 at every
depth would draft otherwise); `mtp_modules="first"` runs `mtp_draft` at every depth, which changes the acceptance
and never the output. A config whose graph list misses a module's draft graph is refused with one line.

The suite builds `--compile none` (the five AOTInductor packages take ~90 s on the loaded 2-core machine);
`MTP_TEST_MIMO_V2_COMPILE=auto` builds mtp-build's default (the packages, with `--keep-onnx` the ONNX weights) and runs every test on the compiled
executor too (docs/MODELS.md "MiMo-V2-Flash" has the by-hand result)."""

from __future__ import annotations

import json
import os

import onnx
import pytest

from builder import cli
from models.engine_format import EngineDirError, load_engine_config
from models.engine_format.compiled import compiled_info
from models.testing_mimo_v2 import make_mimo_v2_checkpoint
from plugins.names import KV_WRITE, SWA_PAGED_ATTENTION
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine
from tests.builder.engine_edits import copy_engine, edit_config
from tests.runtime.engine_utils import random_prompts

pytest.importorskip("transformers")

VOCAB = 6  # a random MTP module agrees with the main model ~1/vocab of the time: accepted AND rejected drafts
LIMITS = dict(max_batch=4, max_num_tokens=32, max_seq_len=64, kv_block_size=4, num_draft_tokens=3)
PROMPTS = random_prompts((5, 13, 9, 22, 3), vocab=VOCAB, seed=0)
PROMPTS.append(PROMPTS[3][:17] + [1, 2, 3])  # shares 4 full blocks with prompt 3: a prefix-cache hit
PARAMS = SamplingParams(max_tokens=12)
DRAFTS = ("mtp_draft", "mtp_draft_1", "mtp_draft_2")
RUN = dict(max_prefill_chunk=6)  # chunks shorter than the prompts; everything else is the engine's limits


@pytest.fixture(scope="module")
def mimo_v2(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_v2_engine")
    make_mimo_v2_checkpoint(root / "ckpt", seed=6, vocab_size=VOCAB)  # the lossless test's: drafts get accepted
    compile_ = os.environ.get("MTP_TEST_MIMO_V2_COMPILE", "none")  # compiled: with the ONNX weights, for both executors
    argv = ["--checkpoint", str(root / "ckpt"), "--output", str(root / "engine"), "--compile", compile_,
            *([] if compile_ == "none" else ["--keep-onnx"])]  # fmt: skip
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 0  # ids-only (no tokenizer.json): requests are token ids
    return root / "ckpt", root / "engine"


def _torch_run(ckpt, engine, k: int, **rc):
    """The torch executor on the checkpoint with the engine's limits: (output ids, acceptance per position)."""
    lim = load_engine_config(engine).limits
    eng = create_engine(checkpoint=ckpt, executor="torch", num_draft_tokens=k, block_size=LIMITS["kv_block_size"],
                        num_blocks=load_engine_config(engine).kv.num_blocks, max_batch=lim.max_batch,
                        max_num_tokens=lim.max_num_tokens, max_seq_len=lim.max_seq_len, **RUN, **rc)  # fmt: skip
    return [o.output_ids for o in eng.generate(PROMPTS, PARAMS)], eng.metrics.acceptance_rate_per_position


@pytest.fixture(scope="module")
def torch_runs(mimo_v2):
    ckpt, engine = mimo_v2
    return {(k, policy): _torch_run(ckpt, engine, k, mtp_modules=policy)
            for k, policy in ((0, "per-depth"), (3, "per-depth"), (3, "first"))}  # fmt: skip


def _executors(engine) -> list[str]:
    return ["onnxruntime"] + (["compiled"] if compiled_info(load_engine_config(engine)) else [])


def _planes(engine, graph: str, op: str) -> list[int]:
    g = onnx.load(str(load_engine_config(engine).graph_file(0, graph)), load_external_data=False).graph
    return sorted(next(a.i for a in n.attribute if a.name == "plane") for n in g.node if n.op_type == op)


def test_one_draft_graph_per_module_is_built_recorded_and_checked(mimo_v2):
    ckpt, engine = mimo_v2
    cfg = load_engine_config(engine)
    assert json.loads((engine / "config.json").read_text())["graphs"][0].keys() == {"main", *DRAFTS, "mtp_commit"}
    planes = [cfg.model.num_hidden_layers + j for j in range(3)]  # module j's KV plane
    for j, name in enumerate(DRAFTS):  # module j attends over its own plane and writes its own and the later ones'
        assert _planes(engine, name, SWA_PAGED_ATTENTION) == [planes[j]], name
        assert _planes(engine, name, KV_WRITE) == planes[j:], name
    assert _planes(engine, "mtp_commit", KV_WRITE) == planes  # the commit pass writes every module's plane
    if compiled_info(cfg):
        assert set(compiled_info(cfg)["graphs"]) == {"main", *DRAFTS, "mtp_commit"}
    assert cli.main(["--check", str(engine)]) == 0  # with packages: each one == the torch model on a probe batch


def test_engines_match_the_torch_executor_depth_by_depth(mimo_v2, torch_runs):
    ckpt, engine = mimo_v2
    want = torch_runs[0, "per-depth"][0]
    assert len(set(map(tuple, want))) > 1
    for executor in _executors(engine):
        for k in (0, 3):
            eng = create_engine(engine_dir=engine, executor=executor, num_draft_tokens=k, **RUN)
            got = [o.output_ids for o in eng.generate(PROMPTS, PARAMS)]
            assert got == want, f"{executor} K={k}"
            assert eng.metrics.prefix_hit_tokens > 0
            eng.kv.assert_no_leaks()
            if k:  # the same drafts as the torch executor's depth d = module d: the same acceptance at every depth
                rates = eng.metrics.acceptance_rate_per_position
                assert rates == torch_runs[3, "per-depth"][1], f"{executor}: {rates}"
                assert 0 < rates[0] < 1, f"{executor}: accepted and rejected drafts must both occur"


def test_first_module_policy_changes_acceptance_not_output(mimo_v2, torch_runs):
    ckpt, engine = mimo_v2
    per_depth, first = torch_runs[3, "per-depth"][1], torch_runs[3, "first"][1]
    assert per_depth != first  # the module choice is load-bearing on this checkpoint
    for executor in _executors(engine):
        eng = create_engine(engine_dir=engine, executor=executor, num_draft_tokens=3, mtp_modules="first", **RUN)
        assert [o.output_ids for o in eng.generate(PROMPTS, PARAMS)] == torch_runs[0, "per-depth"][0], executor
        assert eng.metrics.acceptance_rate_per_position == first, executor


def test_a_graph_list_without_every_modules_draft_graph_is_refused_with_one_line(mimo_v2, tmp_path):
    ckpt, engine = mimo_v2
    copy = copy_engine(engine, tmp_path)
    graphs = json.loads((copy / "config.json").read_text())["graphs"]
    del graphs[0]["mtp_draft_2"]
    edit_config(copy, graphs=graphs)
    with pytest.raises(EngineDirError, match=r"rank0 has graphs \[.*\], expected \[.*'mtp_draft_2'.*\]") as e:
        load_engine_config(copy)
    assert "\n" not in str(e.value)

"""mtp-bench: the --quick smoke run end to end, the bandwidth bound's parameter count, the GGUF wrapper's
pre-tokenizer guard, (when `make bench-peers` has built llama.cpp) llama.cpp's greedy output against ours, and
the revision A/B's round (runtime/bench/decode_round.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from models.config import ModelConfig
from runtime.bench.bound import forward_params
from runtime.bench.gguf import GGUFError, check_gpt2_pretokenizer, gguf_path, gguf_type
from runtime.bench.llama_cpp import LlamaCppRunner
from runtime.bench.setup import DEFAULT_LLAMA_BIN, DEFAULT_LLAMA_SRC

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
LLAMA_BIN, LLAMA_SRC = ROOT / DEFAULT_LLAMA_BIN, ROOT / DEFAULT_LLAMA_SRC
needs_llama = pytest.mark.skipif(not (LLAMA_BIN / "llama-speculative-simple").is_file(),
                                 reason="llama.cpp not built (make bench-peers)")  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_quick_smoke_run_writes_json_readme_and_plots(tmp_path):
    """--random --quick: every configuration runs, ours is lossless, K=auto and llama.cpp are skipped with notes."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "runtime.bench", "--random", "--quick", "--executors", "torch", "--ks", "0,1,2,auto",
           "--batches", "1,2", "--num-prompts", "2", "--max-tokens", "12", "--output-dir", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((out / "bench.json").read_text())
    tps = res["tokens_per_second"]
    assert set(tps["torch"]["1"]) >= {"0", "1", "2"} and set(tps["torch"]["2"]) >= {"0", "1", "2"}
    assert set(tps["hf"]["1"]) == {"0", "1"}, "HF generate plain and use_mtp=True at batch 1"
    assert all(v == "ok" for v in res["lossless_checks"].values()) and not res["warnings"]
    n_ks = 3 + ("auto" in tps["torch"]["1"])
    assert len(res["lossless_checks"]) == 2 * n_ks * 2 + 1  # 2 batches x Ks x 2 rounds + the ablation
    assert res["settings"]["threads"] == 1 and res["machine"]["torch_num_threads"] == 1
    assert any("llama.cpp skipped" in n for n in res["notes"])
    if "auto" not in tps["torch"]["1"]:
        assert any(n.startswith("K=auto skipped") for n in res["notes"])
    entry = tps["torch"]["1"]["0"]
    assert entry["bound_step_ms"] > 0 and entry["step_ms_median"] > 0
    readme = (out / "README.md").read_text()
    assert "| ours (torch) | 0 | 1 |" in readme and "HF generate(use_mtp=True)" in readme and "bound ms/step" in readme
    for png in ("acceptance_by_position.png", "tokens_per_second_vs_k.png"):
        assert (out / png).stat().st_size > 1000
    # the README is a pure function of bench.json: regenerating it gives the same text
    subprocess.run([sys.executable, "-m", "runtime.bench.table", str(out / "bench.json")], env=_env(), cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    assert (out / "README.md").read_text() == readme
    # ... and the top README's table is spliced between its markers, the rest of the file untouched
    from runtime.bench.table import BEGIN, END, splice_readme

    top = tmp_path / "TOP.md"
    top.write_text(f"# intro\n{BEGIN}\nstale table\n{END}\n## after\n")
    splice_readme(res, top)
    text = top.read_text()
    assert text.startswith("# intro\n") and text.endswith(f"{END}\n## after\n") and "stale table" not in text
    assert "| ours (torch) | 0 | 1 |" in text
    (tmp_path / "NOMARK.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="markers"):
        splice_readme(res, tmp_path / "NOMARK.md")


def test_bad_k_is_a_one_line_error():
    p = subprocess.run([sys.executable, "-m", "runtime.bench", "--random", "--ks", "0,x"], capture_output=True,
                       text=True, env=_env(), cwd=ROOT, timeout=120, check=False)  # fmt: skip
    assert p.returncode == 2 and "K must be an integer >= 0 or 'auto'" in p.stderr and "Traceback" not in p.stderr


def test_bound_counts_the_parameters_one_decode_forward_reads():
    """Hand count from the checkpoint's tensors: all main-layer weights but the unrouted experts, one embedding row."""
    cfg = ModelConfig.from_hf_dict(json.loads((TINY / "config.json").read_text()))
    main = mtp = 0
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            n = f.get_slice(name).get_shape()
            size = n[0] * (n[1] if len(n) > 1 else 1)
            if ".mlp.experts." in name or name == "model.embed_tokens.weight":
                continue  # counted below: k routed experts per MoE layer, one embedding row per token
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if layer == cfg.num_hidden_layers:
                mtp += size
            else:
                main += size
                mtp += size if name == "lm_head.weight" else 0
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    main += cfg.hidden_size + moe_layers * cfg.num_experts_per_tok * expert
    mtp += cfg.hidden_size + cfg.num_experts_per_tok * expert
    got = forward_params(cfg, 1)
    assert got.main == pytest.approx(main) and got.mtp == pytest.approx(mtp)
    assert forward_params(cfg, 1000).main == pytest.approx(main + 999 * cfg.hidden_size
                                                           + moe_layers * (cfg.n_routed_experts - 2) * expert, rel=1e-3)


def test_gguf_wrapper_refuses_a_pre_tokenizer_that_is_not_gpt2(tmp_path):
    check_gpt2_pretokenizer(TINY)  # ours: plain ByteLevel BPE
    tok = json.loads((TINY / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "_"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(GGUFError, match="not plain GPT-2"):
        check_gpt2_pretokenizer(tmp_path)


def test_gguf_type_is_the_checkpoints_exact_precision():
    """llama.cpp runs its fastest exact type: bf16 for the bf16 checkpoint (models/deep), f32 for an f32 one."""
    assert gguf_type(ROOT / "models" / "deep") == "bf16" and gguf_path(ROOT / "models" / "deep").name == "deep-bf16.gguf"
    assert gguf_type(TINY) == "f32"


@needs_llama
def test_llama_cpp_greedy_output_matches_ours(tmp_path):
    """The GGUF (converted by our wrapper) decodes the same text as our engine at K=0, plain and draft-mtp."""
    from runtime.bench.runners import make_workload, run_engine
    from runtime.factory import create_engine, load_tokenizer

    gguf = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "runtime.bench.gguf", "--checkpoint", str(TINY), "--llama-src",
                    str(LLAMA_SRC), "--outfile", str(gguf)], env=_env(), cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    tok = load_tokenizer(TINY)
    work = make_workload(TINY, 2, 200, 2048, tok)
    eng = create_engine(None, TINY, "torch", num_draft_tokens=0, max_seq_len=400, enable_prefix_caching=False)
    ours = [tok.decode(ids) for ids in run_engine(eng, work.prompts, 1, 40, "t").outputs]
    runner = LlamaCppRunner(LLAMA_BIN, gguf, threads=1, ctx=512)
    for k in (0, 2):
        res, outs = runner.run(work.texts, k, 40)
        texts = res.texts or []
        if k == 0:
            assert texts == ours
        else:  # draft-mtp may run a verify step past max_tokens
            assert all(t.startswith(o) and len(t) < len(o) + 40 for t, o in zip(texts, ours, strict=True)), texts
        assert [o.prompt_tokens for o in outs] == [len(p) for p in work.prompts]
        if k:
            assert 1.0 < res.summary["mean_acceptance_length"] <= 3.0


def test_guard_pairs_the_default_policy_with_k0_and_records_both_clocks(tmp_path):
    """mtp-bench auto guard (runtime/bench/auto_guard.py) on models/tiny, torch, one pair per batch: the JSON
    holds each batch's CPU- and wall-time ratios with the verdict, the default policy stayed lossless, and a second model's
    run adds its own key to the same file."""
    out, readme = tmp_path / "auto_guard.json", tmp_path / "README.md"
    out.write_text(json.dumps({"other": {"command": "x", "results": {}}}))
    readme.write_text("head\n<!-- auto-guard:begin (generated by runtime.bench.auto_guard) -->\nold\n<!-- auto-guard:end -->\ntail\n")
    cmd = [sys.executable, "-m", "runtime.bench.auto_guard", "--checkpoint", str(TINY), "--executors", "torch",
           "--batches", "1,2", "--pairs", "2", "--min-seconds", "0", "--num-prompts", "2", "--max-tokens", "10",
           "--output", str(out), "--readme", str(readme)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res) == {"other", "tiny"} and not res["tiny"]["lossless_failures"]
    for b in ("1", "2"):
        e = res["tiny"]["results"]["torch"][b]
        assert len(e["cpu_ratio"]["runs"]) == len(e["wall_ratio"]["runs"]) == 2
        assert 0 < e["cpu_ratio"]["median"] < 10 and e["holds"] == (e["cpu_ratio"]["median"] >= 0.97)
        assert e["cpu_ratio"]["ci95"][0] <= e["cpu_ratio"]["median"] <= e["cpu_ratio"]["ci95"][1]
    assert res["tiny"]["side"] == "per-request"  # the default policy is what the guard judges unless --side
    assert "| tiny | per-request | torch | 2 | 2 |" in p.stdout
    text = readme.read_text()  # the table went between the markers, the rest of the file untouched
    assert text.startswith("head\n") and text.endswith("tail\n") and "old" not in text
    assert "| tiny | per-request | torch | 1 |" in text


def test_quant_quality_agreement_counts_equal_positions_and_the_first_difference():
    from runtime.bench.quant_quality import agreement

    got = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert got == {"token_agreement": 5 / 6, "mean_tokens_before_first_difference": (2 + 2) / 2}
    assert agreement([[1, 2, 3]], [[1, 2]])["token_agreement"] == 2 / 3  # a shorter output counts as different


def test_decode_round_measures_each_k_on_its_own_engine_and_records_outputs_and_both_clocks():
    """runtime/bench/decode_round.py run as the revision A/B runs it (python -P FILE, the tree on PYTHONPATH):
    the torch executor on models/tiny (no engine build)."""
    cmd = [sys.executable, "-P", str(ROOT / "runtime" / "bench" / "decode_round.py"), "--checkpoint",
           str(TINY), "--executor", "torch", "--ks", "0,2", "--batches", "1,2", "--num-prompts", "2",
           "--max-tokens", "12"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)
    assert set(res["runs"]) == {"b1_k0", "b1_k2", "b2_k0", "b2_k2"} and len(res["prompt_files"]) == 2
    assert res["runs"]["b1_k0"]["decode_tokens"] == res["runs"]["b1_k0"]["decode_steps"]  # one token per step
    for b in (1, 2):
        k0, k2 = res["runs"][f"b{b}_k0"], res["runs"][f"b{b}_k2"]
        assert k2["outputs"] == k0["outputs"] and all(len(o) == 12 for o in k0["outputs"])
        # K=2 drafts: fewer decode steps than K=0 for the same tokens (one K's engine for every K would not)
        assert k2["decode_steps"] < k0["decode_steps"]
        assert all(r["decode_tps"] > 0 and r["decode_cpu_tps"] > 0 for r in (k0, k2))

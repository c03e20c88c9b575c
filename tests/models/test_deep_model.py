"""The shipped deep model (models/deep, made by `make deep-model`) is a valid, trained, realistic-depth checkpoint.

Checks: GLM-4.5 layout at >= 12 layers (dense layer 0, MoE after, one MTP module, GQA); bf16 matrices that
both loaders upcast exactly; our main logits match transformers' on a tokenized snippet; a draft depth is cheap
next to a main forward; and a re-measurement on held-out stdlib files gives chained per-depth acceptance
(unconditional and conditional) close to training_report.json's and above a floor, so a broken or untrained
MTP module fails (re-initialising eh_proj alone drops every depth to ~0.01).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from models.checkpoint import load_model
from models.training.chained import chain_matches, chained_losses
from models.training.configs import per_token_macs
from models.training.tokenizer import EOS_TOKEN, load_tokenizer
from tests.models.shipped import MODELS, SNIPPET, heldout_middle_windows, paged_main_logits, read_report

transformers = pytest.importorskip("transformers")

DEEP = MODELS / "deep"
DEPTHS = 3
WINDOW = 512  # tokens scored per held-out file
N_FILES = 3
# Floors: an untrained or broken MTP module scores ~0.01; the trained one measures ~0.60 / 0.35 / 0.22 unconditional
# and ~0.6 conditional here. Tolerance: three files are a small sample of the report's ~65k held-out tokens.
MIN_UNCONDITIONAL = (0.4, 0.2, 0.1)
MIN_CONDITIONAL = 0.45
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def report() -> dict:
    return read_report(DEEP, "deep-model")


@pytest.fixture(scope="module")
def ours(report):
    model, _ = load_model(DEEP)
    return model


def test_checkpoint_is_complete_and_under_30_mb(report):
    names = {p.name for p in DEEP.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in DEEP.iterdir()) < 30 * 2**20


def test_realistic_depth_glm45_layout(ours, report):
    cfg = ours.cfg
    assert cfg.num_hidden_layers >= 12 and cfg.first_k_dense_replace == 1
    assert all(cfg.is_moe_layer(i) for i in range(1, cfg.num_hidden_layers)) and not cfg.is_moe_layer(0)
    assert cfg.n_routed_experts >= 8 and cfg.num_experts_per_tok == 2 and cfg.n_shared_experts >= 1
    assert cfg.n_group > 1 and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_nextn_predict_layers == 1 and len(ours.mtp) == 1
    assert cfg.eos_token_id == (load_tokenizer(DEEP).token_to_id(EOS_TOKEN),)
    assert report["settings"]["mtp_lambdas"] and len(report["settings"]["mtp_lambdas"]) >= DEPTHS


def test_bf16_matrices_load_as_exact_fp32(ours):
    with safe_open(str(DEEP / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 - safe_open has no iter
        embed = f.get_tensor("model.embed_tokens.weight")
    assert {d for n, d in dtypes.items() if n.endswith("e_score_correction_bias") or "norm" in n} == {"F32"}
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["lm_head.weight"] == "BF16"
    assert ours.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(ours.embed_tokens.weight, embed.float())


def test_main_logits_match_hf(ours):
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(str(DEEP), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(DEEP))
    ids = torch.tensor(tok(SNIPPET)["input_ids"])
    assert tok.decode(ids) == SNIPPET
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(paged_main_logits(ours, ids), expected, atol=1e-4, rtol=1e-4)


def test_draft_depth_is_cheap_next_to_a_main_forward(ours):
    """Per-token multiply-accumulates at 512 tokens of context: one draft depth vs one main forward.

    (The 3-layer tiny model's ratio is ~0.5, which is why it cannot show a speed-up.) The shared 2048-row
    lm_head is about half of a draft depth, which bounds this ratio at this width."""
    main, draft = per_token_macs(ours.cfg, context=512)
    assert draft / main < 0.16, f"a draft depth costs {draft / main:.3f} of a main forward"


def test_heldout_chained_acceptance_matches_report(ours, report):
    windows = heldout_middle_windows(report, load_tokenizer(DEEP), n_files=N_FILES, window=WINDOW)
    if not windows:
        pytest.skip("none of the held-out stdlib files exist here (different Python install)")
    hits = torch.zeros(DEPTHS)
    positions = 0
    with torch.no_grad():
        for w in windows:
            _, _, main_logits, mtp_logits = chained_losses(ours, w[None], DEPTHS)
            all_match = chain_matches(main_logits, mtp_logits).cumprod(0)
            hits += all_match.flatten(1).sum(1).float()
            positions += all_match[0].numel()
    uncond = (hits / positions).tolist()
    cond = [uncond[0]] + [uncond[j] / max(uncond[j - 1], 1e-9) for j in range(1, DEPTHS)]
    rep_uncond = report["heldout"]["acceptance_unconditional"]
    rep_cond = report["heldout"]["acceptance_conditional"]
    for j in range(DEPTHS):
        msg = (
            f"depth {j + 1}: measured {uncond[j]:.3f} / {cond[j]:.3f}, reported {rep_uncond[j]:.3f} / {rep_cond[j]:.3f}"
        )
        assert uncond[j] >= MIN_UNCONDITIONAL[j] and cond[j] >= MIN_CONDITIONAL, msg
        assert rep_uncond[j] >= MIN_UNCONDITIONAL[j] and rep_cond[j] >= MIN_CONDITIONAL, msg
        assert abs(uncond[j] - rep_uncond[j]) <= TOLERANCE and abs(cond[j] - rep_cond[j]) <= TOLERANCE, msg

"""The shipped tiny model (models/tiny, made by `make tiny-model`) is a valid, genuinely trained checkpoint.

Checks: it loads with our importer and with transformers (+ AutoTokenizer); our main logits match HF's on a
tokenized snippet; the MTP module is there; and a quick measurement on held-out stdlib files gives an MTP
greedy acceptance close to the one in training_report.json (a broken or untrained model fails this).
"""

from __future__ import annotations

import pytest
import torch

from models.checkpoint import load_model, read_checkpoint
from models.training.eval import greedy_acceptance, mtp_losses
from models.training.tokenizer import EOS_TOKEN, load_tokenizer
from tests.models.shipped import MODELS, SNIPPET, heldout_middle_windows, paged_main_logits, read_report

transformers = pytest.importorskip("transformers")

TINY = MODELS / "tiny"
MIN_ACCEPTANCE = 0.3  # far above an untrained model on code (~0 after the first tokens), far below a trained one
WINDOW = 512  # tokens scored per held-out file
ACCEPTANCE_TOLERANCE = 0.15  # two files are a small sample; the report's number is over ~65k held-out tokens


@pytest.fixture(scope="module")
def report() -> dict:
    return read_report(TINY, "tiny-model")


@pytest.fixture(scope="module")
def ours(report):
    model, _ = load_model(TINY)
    return model


def test_checkpoint_is_small_and_complete(report):
    names = {p.name for p in TINY.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in TINY.iterdir()) < 25 * 2**20


def test_mtp_module_present(ours, report):
    cfg = ours.cfg
    assert cfg.num_nextn_predict_layers == 1 and len(ours.mtp) == 1
    tensors = read_checkpoint(TINY).tensors
    assert f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in tensors  # GLM-4.5 layout: MTP after the layers
    assert cfg.eos_token_id == (load_tokenizer(TINY).token_to_id(EOS_TOKEN),)
    assert cfg.max_position_embeddings >= 1024 and cfg.num_key_value_heads < cfg.num_attention_heads


def test_main_logits_match_hf(ours):
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(str(TINY), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(TINY))
    assert tok.eos_token == EOS_TOKEN
    ids = torch.tensor(tok(SNIPPET)["input_ids"])
    assert tok.decode(ids) == SNIPPET  # byte-level BPE round-trips
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = paged_main_logits(ours, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_heldout_mtp_acceptance_matches_report(ours, report):
    tok = load_tokenizer(TINY)
    windows = heldout_middle_windows(report, tok, n_files=2, window=WINDOW)
    if not windows:
        pytest.skip("none of the held-out stdlib files exist here (different Python install)")
    matches = total = 0
    main_loss = 0.0
    with torch.no_grad():
        for w in windows:
            main_ce, _, main_logits, mtp_logits = mtp_losses(ours, w[None])
            k, n = greedy_acceptance(main_logits, mtp_logits)
            matches, total, main_loss = matches + k, total + n, main_loss + float(main_ce) / len(windows)
    acceptance = matches / total
    reported = report["heldout"]["mtp_greedy_acceptance"]
    assert acceptance >= MIN_ACCEPTANCE, f"acceptance {acceptance:.3f}: model broken or untrained?"
    assert abs(acceptance - reported) <= ACCEPTANCE_TOLERANCE, f"{acceptance:.3f} vs reported {reported:.3f}"
    assert main_loss < report["heldout"]["main_loss"] + 1.0, f"held-out main loss {main_loss:.3f} is far off"

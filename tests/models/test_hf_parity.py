"""Main-model and MTP-module parity with Hugging Face transformers (the independent reference).

Each case writes a random checkpoint in the HF Glm4Moe layout with our exporter, loads it with both
transformers and our importer, and compares logits in fp32 within 1e-4. `fused` runs the inference
layout the torch executor uses (`Glm4MoeMTPModel.fuse()`: one QKV and one gate|up GEMM), `unfused` the
checkpoint's own modules; both go through the per-forward RoPE tables and planned plugin ops.
"""

from __future__ import annotations

import pytest
import torch

from models.checkpoint import load_model
from models.layers import PagedKV, StepMeta
from models.testing import make_checkpoint, tiny_config
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address

transformers = pytest.importorskip("transformers")

CASES = {
    "dense_only": dict(n_routed_experts=0, first_k_dense_replace=2, num_experts_per_tok=0, moe_intermediate_size=0,
                       n_shared_experts=0),
    "moe": dict(),
    "moe_qknorm_bias": dict(use_qk_norm=True, attention_bias=True),
    "moe_full_rotary_mha": dict(partial_rotary_factor=1.0, num_key_value_heads=4, n_group=1, topk_group=1),
    "moe_grouped_routing": dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3),
}  # fmt: skip


def load_ours(path, layout: str = "fused"):
    model, _ = load_model(path)
    return model.fuse() if layout == "fused" else model


def load_hf(path):
    model = transformers.Glm4MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model


def kv_for(model, num_blocks=16, block_size=4):
    cfg = model.cfg
    geom = KVPoolGeometry(model.num_kv_planes, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    pool = allocate_pool(geom)
    return pool, PagedKV(pool_address(pool), geom)


def prefill_meta(n: int, block_size=4) -> StepMeta:
    table = torch.arange(1, 1 + (n + block_size - 1) // block_size, dtype=torch.int32)[None]
    return StepMeta(torch.arange(n), torch.tensor([n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), table)


@pytest.mark.parametrize("layout", ["fused", "unfused"])
@pytest.mark.parametrize("case", list(CASES))
def test_main_logits_match_hf(tmp_path, case, layout):
    cfg = tiny_config(**CASES[case])
    make_checkpoint(tmp_path, cfg, seed=1)
    ours = load_ours(tmp_path, layout)
    hf = load_hf(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        pool, kv = kv_for(ours)
        got = ours.compute_logits(ours.forward_main(ids, prefill_meta(len(ids)), kv))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_main_logits_chunked_and_packed_match_hf(tmp_path):
    """Two requests packed in one forward, the second continuing a chunk: same logits as HF."""
    cfg = tiny_config()
    make_checkpoint(tmp_path, cfg, seed=3)
    ours = load_ours(tmp_path)
    hf = load_hf(tmp_path)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, cfg.vocab_size, (9,), generator=g), torch.randint(0, cfg.vocab_size, (11,), generator=g)
    pool, kv = kv_for(ours)
    tables = torch.tensor([[1, 2, 3, -1], [4, 5, 6, 7]], dtype=torch.int32)
    with torch.no_grad():
        # step 1: a[:6] and b[:5]; step 2: a[6:] and b[5:] (chunks cross block boundaries mid-block)
        m1 = StepMeta(torch.cat([torch.arange(6), torch.arange(5)]), torch.tensor([6, 5], dtype=torch.int32),
                      torch.tensor([6, 5], dtype=torch.int32), tables)  # fmt: skip
        h1 = ours.forward_main(torch.cat([a[:6], b[:5]]), m1, kv)
        m2 = StepMeta(torch.cat([torch.arange(6, 9), torch.arange(5, 11)]), torch.tensor([3, 6], dtype=torch.int32),
                      torch.tensor([9, 11], dtype=torch.int32), tables)  # fmt: skip
        h2 = ours.forward_main(torch.cat([a[6:], b[5:]]), m2, kv)
        got_a = ours.compute_logits(torch.cat([h1[:6], h2[:3]]))
        got_b = ours.compute_logits(torch.cat([h1[6:], h2[3:]]))
        torch.testing.assert_close(got_a, hf(a[None]).logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_b, hf(b[None]).logits[0], atol=1e-4, rtol=1e-4)


def hf_mtp_logits(hf, path, ids):
    """HF's MTP module (the one generate(use_mtp=True) drafts with) over pairs (h_p, t_{p+1})."""
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    num_layers = hf.config.num_hidden_layers
    # transformers finds MTP weights through these patterns; its defaults name only GLM-4.5's sizes.
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{num_layers}\..*"]
    mtp = MtpModel.from_pretrained(hf, device_map={"": "cpu"}).eval()
    out = hf(ids[None], output_hidden_states=True)
    hidden = out.hidden_states[-1]  # post-final-norm: what MTPCandidateGenerator feeds the MTP module
    n = len(ids)
    cache = MtpCache(config=hf.config.get_mtp_config())
    h = mtp.forward_layer(0, hidden[:, : n - 1], torch.arange(1, n)[None], cache, input_ids=ids[None, 1:])
    return hidden[0], mtp._project_to_logits(h)[0], h[0]


@pytest.mark.parametrize("layout", ["fused", "unfused"])
@pytest.mark.parametrize("case", ["moe", "moe_qknorm_bias", "moe_full_rotary_mha"])
def test_mtp_draft_matches_hf(tmp_path, case, layout):
    """Draft depth run position by position (each writes then reads the MTP plane) == HF's MTP layer."""
    cfg = tiny_config(**CASES[case])
    make_checkpoint(tmp_path, cfg, seed=5)
    ours = load_ours(tmp_path, layout)
    hf = load_hf(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hidden, expected_logits, expected_hidden = hf_mtp_logits(hf, tmp_path, ids)
        pool, kv = kv_for(ours)
        table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
        ours.forward_main(ids, prefill_meta(len(ids)), kv)
        for p in range(len(ids) - 1):
            h_out, logits = ours.forward_draft(hidden[p : p + 1], ids[p + 1 : p + 2], torch.tensor([p]),
                                               torch.tensor([1], dtype=torch.int32), table, kv)  # fmt: skip
            torch.testing.assert_close(logits[0], expected_logits[p], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(h_out[0], expected_hidden[p], atol=1e-4, rtol=1e-4)


def test_mtp_commit_pass_then_draft_matches_hf(tmp_path):
    """Commit rows 0..n-3 in one packed K/V-only write, then draft at n-2: equals HF's last MTP row."""
    cfg = tiny_config(use_qk_norm=True)
    make_checkpoint(tmp_path, cfg, seed=7)
    ours = load_ours(tmp_path)
    hf = load_hf(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(8))
    n = len(ids)
    with torch.no_grad():
        hidden, expected_logits, _ = hf_mtp_logits(hf, tmp_path, ids)
        pool, kv = kv_for(ours)
        table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
        written = ours.forward_commit(hidden[: n - 2], ids[1 : n - 1], torch.tensor([n - 2], dtype=torch.int32),
                                      torch.tensor([0], dtype=torch.int32), table, kv)  # fmt: skip
        assert int(written) == n - 2
        _, logits = ours.forward_draft(hidden[n - 2 : n - 1], ids[n - 1 :], torch.tensor([n - 2]),
                                       torch.tensor([1], dtype=torch.int32), table, kv)  # fmt: skip
    torch.testing.assert_close(logits[0], expected_logits[n - 2], atol=1e-4, rtol=1e-4)


def test_training_forward_matches_hf(tmp_path):
    """The dense training path (used by models/training/train.py) computes the same main and MTP logits."""
    cfg = tiny_config()
    make_checkpoint(tmp_path, cfg, seed=9)
    ours, _ = load_model(tmp_path)
    hf = load_hf(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        _, expected_mtp, _ = hf_mtp_logits(hf, tmp_path, ids)
        logits, mtp_logits = ours.forward_train(ids[None])
    torch.testing.assert_close(logits[0], hf(ids[None]).logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mtp_logits[0], expected_mtp, atol=1e-4, rtol=1e-4)

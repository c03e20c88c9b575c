"""DeepSeek Sparse Attention (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`) parity with transformers.

Checkpoints are written by transformers (models/testing_dsa.py, index_topk 8) and run by both; contexts of 24 tokens
cross index_topk, so the indexer's top-k selection and the sparse attention decide the logits (a test forces the
dense path and shows the logits move exactly from position index_topk on). The MTP layer has its own indexer: its
drafts are compared with a reference assembled from transformers' own decoder layer, and a planted bug that feeds it
the main model's top-k instead must fail that comparison.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models.checkpoint import load_model
from models.config import ConfigError, ModelConfig
from models.dsa import DSAAttention
from models.testing_dsa import DSA_VARIANTS, make_dsa_checkpoint
from tests.models.test_mla_parity import ReferenceMTP, draft_logits, ids_for, kv_for, meta, paged_logits

transformers = pytest.importorskip("transformers")

I32 = torch.int32
N = 24  # > index_topk (8): the sparse path decides every row from position 8 on


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    """variant -> (checkpoint path, our fused model, transformers' model), each made once."""
    made: dict = {}

    def get(variant: str):
        if variant not in made:
            model_type, overrides = DSA_VARIANTS[variant]
            path = tmp_path_factory.mktemp(variant)
            make_dsa_checkpoint(path, model_type, seed=1, **overrides)
            cls = transformers.DeepseekV32ForCausalLM if model_type == "deepseek_v32" else transformers.GlmMoeDsaForCausalLM
            hf = cls.from_pretrained(str(path), dtype=torch.float32).eval()
            made[variant] = (path, load_model(path)[0].fuse(), hf)
        return made[variant]

    return get


def test_config_import_and_refusals():
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=4, index_topk=64).to_dict()
    cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.is_dsa, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (True, 32, 128, 64)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    shared = ModelConfig.from_hf_dict({**hf, "indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 1})
    assert shared.index_pattern == "FSFS"  # transformers' schedule: full where (i - offset + 1) % freq == 0
    assert ModelConfig.from_dict(shared.to_dict()) == shared
    with pytest.raises(ConfigError, match="the first 'full'"):
        ModelConfig.from_hf_dict({**hf, "indexer_types": ["shared", "full", "full", "full"]})
    with pytest.raises(ConfigError, match="index_head_dim=600 must be in"):
        ModelConfig.from_hf_dict({**hf, "index_head_dim": 600})
    with pytest.raises(ConfigError, match="needs q_lora_rank > 0"):
        ModelConfig.from_hf_dict({**transformers.DeepseekV32Config().to_dict(), "q_lora_rank": None})


@pytest.mark.parametrize("variant", list(DSA_VARIANTS))
def test_main_logits_match_hf_and_the_sparse_path_takes_over_past_index_topk(dsa, variant):
    """Prefill 6 tokens (dense: below index_topk), then decode to 24 one token per step (sparse from position 8)."""
    _, ours, hf = dsa(variant)
    ids = ids_for(ours.cfg, N, seed=2)
    topk = ours.cfg.index_topk
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        got = paged_logits(ours, ids, prefill=6)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        attns = [m for m in ours.modules() if isinstance(m, DSAAttention)]
        try:
            for m in attns:
                m.index_topk = 10**6  # dense attention everywhere
            dense = paged_logits(ours, ids, prefill=6)
        finally:
            for m in attns:
                m.index_topk = topk
    assert expected.abs().max() > 0.1, "logits this small would hide a wrong formula"
    torch.testing.assert_close(dense[:topk], got[:topk], atol=1e-5, rtol=1e-5)  # below index_topk: dense
    assert (dense[topk:] - got[topk:]).abs().amax(-1).min() > 1e-3, "every row past index_topk must be sparse"


def test_packed_chunked_requests_match_hf(dsa):
    """Two requests packed in one forward, chunks crossing block boundaries and index_topk mid-chunk."""
    _, ours, hf = dsa("dsv32")
    a, b = ids_for(ours.cfg, 20, seed=4), ids_for(ours.cfg, 22, seed=5)
    _, kv = kv_for(ours)
    tables = torch.tensor([[1, 2, 3, 4, 5, -1], [6, 7, 8, 9, 10, 11]], dtype=I32)
    with torch.no_grad():
        h1 = ours.forward_main(torch.cat([a[:6], b[:11]]), meta(torch.cat([torch.arange(6), torch.arange(11)]),
                                                                [6, 11], [6, 11], tables), kv)  # fmt: skip
        h2 = ours.forward_main(torch.cat([a[6:], b[11:]]), meta(torch.cat([torch.arange(6, 20), torch.arange(11, 22)]),
                                                                [14, 11], [20, 22], tables), kv)  # fmt: skip
        torch.testing.assert_close(ours.compute_logits(torch.cat([h1[:6], h2[:14]])), hf(a[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
        torch.testing.assert_close(ours.compute_logits(torch.cat([h1[6:], h2[14:]])), hf(b[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


class ReferenceDSAMTP(ReferenceMTP):
    """ReferenceMTP around transformers' own DSA decoder layer (its indexer included); GLM-5's layer also returns
    its top-k indices."""

    def __init__(self, hf, tensors: dict[str, torch.Tensor], layer: int) -> None:
        one = {**hf.config.to_dict(), "num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "layer_types": None}
        if one.get("indexer_types"):
            one["indexer_types"] = ["full"]
        proxy = copy.copy(hf)  # the same modules, a one-layer config (ReferenceMTP builds the block from it)
        proxy.config = hf.config.__class__(**one)
        super().__init__(proxy, tensors, layer)
        self.hf = hf

    def forward(self, hidden, token_ids, positions):
        x = torch.cat([self.norm(self.hf.model.embed_tokens(token_ids), self.enorm), self.norm(hidden, self.hnorm)], -1)
        x = x @ self.eh_proj.T
        s = x.shape[1]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_embeddings=self.hf.model.rotary_emb(x, positions),
                         position_ids=positions)  # fmt: skip
        return self.hf.lm_head(self.norm(out[0] if isinstance(out, tuple) else out, self.final))


def reference_drafts(path, hf, ids):
    from safetensors.torch import load_file

    ref = ReferenceDSAMTP(hf, load_file(str(path / "model.safetensors")), hf.config.num_hidden_layers)
    n = len(ids)
    hidden = hf(ids[None], output_hidden_states=True).hidden_states[-1]
    return ref(hidden[:, : n - 1], ids[None, 1:], torch.arange(n - 1)[None])[0]


@pytest.mark.parametrize("variant", list(DSA_VARIANTS))
def test_mtp_draft_logits_match_reference_with_its_own_indexer(dsa, variant):
    path, ours, hf = dsa(variant)
    ids = ids_for(ours.cfg, N, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(ours, ids), reference_drafts(path, hf, ids), atol=1e-4, rtol=1e-4)


def test_planted_bug_mtp_fed_the_main_models_top_k_is_caught(dsa, monkeypatch):
    """What collapsed acceptance elsewhere (ROCm/ATOM#1362): the MTP layer attending to the main model's (last
    layer's) top-k for the same position instead of its own indexer's. The draft comparison above must fail."""
    path, ours, hf = dsa("glm5")
    ids = ids_for(ours.cfg, N, seed=8)
    main, mtp = ours.layers[-1].self_attn, ours.mtp[0].block.self_attn
    captured: dict[int, torch.Tensor] = {}
    main_select = main.select

    def record(x, q_resid, m, kv):
        selected = main_select(x, q_resid, m, kv)
        captured.update({int(p): row for p, row in zip(m.positions, selected, strict=True)})
        return selected

    monkeypatch.setattr(main, "select", record)
    monkeypatch.setattr(mtp, "select", lambda x, q_resid, m, kv: torch.stack([captured[int(p)] for p in m.positions]))
    with torch.no_grad():
        planted = draft_logits(ours, ids)
        expected = reference_drafts(path, hf, ids)
    topk = ours.cfg.index_topk
    assert len(captured) == N, "the main model's selection was captured for every position"
    torch.testing.assert_close(planted[: topk - 1], expected[: topk - 1], atol=1e-4, rtol=1e-4)  # dense there
    assert (planted[topk:] - expected[topk:]).abs().max() > 1e-3, "the planted top-k reuse went unnoticed"


@pytest.mark.parametrize("variant", list(DSA_VARIANTS))
def test_commit_pass_writes_the_mtp_indexer_keys(dsa, variant):
    """Commit rows 0..n-3 in one write (latent rows and the MTP layer's own indexer keys), then draft at n-2: equals
    the all-draft path's last row; and the MTP key plane holds exactly the keys the drafts wrote."""
    _, ours, _ = dsa(variant)
    ids = ids_for(ours.cfg, N, seed=9)
    n, table = len(ids), torch.arange(1, 9, dtype=I32)[None]
    mtp = ours.mtp[0].block.self_attn
    with torch.no_grad():
        expected = draft_logits(ours, ids)[n - 2]
        pool, kv = kv_for(ours)
        hidden = ours.forward_main(ids, meta(torch.arange(n), [n], [n], table), kv)
        written = ours.forward_commit(hidden[: n - 2], ids[1 : n - 1], torch.tensor([n - 2], dtype=I32),
                                      torch.tensor([0], dtype=I32), table, kv)  # fmt: skip
        assert int(written) == n - 2
        keys = pool[mtp.index_plane, 0, 1:].reshape(-1, pool.shape[-1])[: n - 2]
        assert keys.abs().amax(-1).min() > 0 and not keys[:, ours.cfg.index_head_dim :].any()
        _, logits = ours.forward_draft(hidden[n - 2 : n - 1], ids[n - 1 :], torch.tensor([n - 2]),
                                       torch.tensor([1], dtype=I32), table, kv)  # fmt: skip
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_tensor_parallel_engine_build_is_refused_in_one_line(dsa, tmp_path, capsys):
    """mtp-build of a DSA checkpoint with --tp-size 2: the indexer is not split over a TP group (docs/MODELS.md), one
    line naming the fix, before anything is exported (the engines themselves: tests/builder/test_dsa_engine.py)."""
    from builder import cli

    path = dsa("glm5")[0]
    capsys.readouterr()  # the checkpoint writer's progress lines
    argv = ["--checkpoint", str(path), "--output", str(tmp_path / "engine"), "--world-size", "2", "--tp-size", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "glm_moe_dsa uses DeepSeek Sparse Attention" in err[0] and "--tp-size 1" in err[0]
    assert not (tmp_path / "engine").exists()



def test_tensorrt_engine_build_is_refused(dsa, tmp_path):
    """The DSA ops' TensorRT plugins are type-checked only (no GPU has run them): refused by the model check, which a
    machine with TensorRT reaches (here the missing library is refused first, so the check is called directly)."""
    from builder.options import BuildError, BuildOptions
    from models.checkpoint_files import read_model_config

    path = dsa("glm5")[0]
    opts = BuildOptions(path, tmp_path / "engine", backend="tensorrt")
    with pytest.raises(BuildError, match=r"glm_moe_dsa uses DeepSeek Sparse Attention, whose TensorRT plugins .* have never been built or run"):
        opts.validate_for_model(read_model_config(path)[0])
    BuildOptions(path, tmp_path / "engine").validate_for_model(read_model_config(path)[0])  # onnxruntime: accepted


def test_fp8_release_imports_dequantized_indexer_included(dsa, tmp_path):
    """The FP8 releases (GLM-5-FP8, DeepSeek-V3.2): float8_e4m3fn projections with 128x128 `weight_scale_inv`, the
    indexer's wq_b and wk among them (weights_proj stays float): imported equal, tensor for tensor, to the float
    checkpoint of the same dequantized values."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from models.fp8 import SCALE_SUFFIX, quantize
    from models.testing import is_fp8_quantized
    from tests.models.test_fp8_import import reference_dequant

    src = dsa("glm5")[0]
    fp8, deq = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if is_fp8_quantized(name, tuple(t.shape)):  # the indexer's wq_b and wk included, its weights_proj not
            fp8[name], fp8[name + SCALE_SUFFIX] = quantize(t)
            deq[name] = reference_dequant(fp8[name], fp8[name + SCALE_SUFFIX])
        else:
            fp8[name] = deq[name] = t
    hf = json.loads((src / "config.json").read_text())
    for d, tensors in (("fp8", fp8), ("deq", deq)):
        (tmp_path / d).mkdir()
        save_file(tensors, str(tmp_path / d / "model.safetensors"), metadata={"format": "pt"})
        q = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}} if d == "fp8" else {}  # fmt: skip
        (tmp_path / d / "config.json").write_text(json.dumps({**hf, **q}))
        shutil.copyfile(src / "generation_config.json", tmp_path / d / "generation_config.json")
    assert fp8["model.layers.0.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    got, want = load_model(tmp_path / "fp8")[0].state_dict(), load_model(tmp_path / "deq")[0].state_dict()
    orig = load_model(src)[0].state_dict()
    for name in got:
        assert torch.equal(got[name], want[name]), name
    for name in ("layers.0.self_attn.indexer.wq_b.weight", "mtp.0.block.self_attn.indexer.wk.weight"):
        assert 0 < (got[name] - orig[name]).abs().max() < 0.1 * orig[name].abs().max(), name

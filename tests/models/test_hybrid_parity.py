"""Qwen3-Next / Qwen3.5 MoE and dense (hybrid Gated DeltaNet + gated attention) parity with transformers.

Checkpoints are written by transformers' own save_pretrained (models/testing.py `make_hybrid_checkpoint`) plus the
MTP module at `mtp.*` as released. The main model's reference is transformers' `Qwen3NextForCausalLM` /
`Qwen3_5MoeForCausalLM` / `Qwen3_5MoeForConditionalGeneration` / `Qwen3_5ForCausalLM` /
`Qwen3_5ForConditionalGeneration` (their pure-PyTorch GDN fallbacks
`torch_chunk_gated_delta_rule` for prefill and `torch_recurrent_gated_delta_rule` + `causal_conv1d_update` for cached
decode); transformers drops `mtp.*` on load, so the MTP reference is assembled from transformers' own decoder layer
and zero-centred RMSNorm classes (`ReferenceHybridMTP`), wired as vLLM's `qwen3_next_mtp.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from models.checkpoint import load_model
from models.config import ConfigError, ModelConfig
from models.gdn import GatedDeltaNet, GDNStatePool, HybridCache
from models.qwen3_next import Qwen3NextMTPModel, ZeroCentredRMSNorm
from models.testing import make_hybrid_checkpoint
from tests.models.test_mla_parity import ids_for, kv_for, meta

transformers = pytest.importorskip("transformers")

I32 = torch.int32
TYPES = ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_5_text", "qwen3_5"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    made: dict = {}

    def get(model_type: str):
        if model_type not in made:
            made[model_type] = tmp_path_factory.mktemp(model_type)
            make_hybrid_checkpoint(made[model_type], model_type, seed=1)
        return made[model_type]

    return get


def load_hf(path):
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    cls = {"qwen3_next": transformers.Qwen3NextForCausalLM, "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
           "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
           "qwen3_5_text": transformers.Qwen3_5ForCausalLM, "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
           }[model_type]  # fmt: skip
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_text_model(hf):
    return hf.model.language_model if hasattr(hf.model, "language_model") else hf.model


def cache(model, kv, state, read_slots, write_slots) -> HybridCache:
    return HybridCache(kv, state, torch.tensor(read_slots, dtype=I32), torch.tensor(write_slots, dtype=I32))


def paged_logits(ours, ids: torch.Tensor, prefill: int, slot: int = 2):
    """Prefill ids[:prefill] in one forward (state stored after its last row), then decode one token per step
    (each reads and rewrites the same slot); logits of every row. Returns (logits, state pool)."""
    _, kv = kv_for(ours)
    state = GDNStatePool.allocate(ours.cfg, 4)
    table = torch.arange(1, 9, dtype=I32)[None]
    c = cache(ours, kv, state, [slot], [-1] * (prefill - 1) + [slot])
    out = [ours.compute_logits(ours.forward_main(ids[:prefill], meta(torch.arange(prefill), [prefill], [prefill],
                                                                       table), c))]  # fmt: skip
    for p in range(prefill, len(ids)):
        c = cache(ours, kv, state, [slot], [slot])
        out.append(ours.compute_logits(ours.forward_main(ids[p : p + 1], meta([p], [1], [p + 1], table), c)))
    return torch.cat(out), state


@pytest.mark.parametrize("model_type", TYPES)
def test_main_logits_match_hf_prefill_and_decode(hybrid, model_type):
    path = hybrid(model_type)
    ours, _ = load_model(path)
    assert isinstance(ours, Qwen3NextMTPModel) and ours.cfg.gdn_layers == (0, 1, 2) and ours.num_kv_planes == 2
    assert ours.cfg.has_moe == ("moe" in model_type or model_type == "qwen3_next")
    ours.fuse()
    ids = ids_for(ours.cfg)
    with torch.no_grad():
        expected = load_hf(path)(ids[None]).logits[0]
        got, _ = paged_logits(ours, ids, prefill=10)
    assert expected.abs().max() > 0.5, "logits this small would hide a wrong formula"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_text"])
def test_decode_matches_hf_cached_generate(hybrid, model_type):
    """transformers' own cached decode path (recurrent GDN rule + conv update) == ours, token for token."""
    path = hybrid(model_type)
    ours, _ = load_model(path)
    hf = load_hf(path)
    ids = ids_for(ours.cfg, 7, seed=3)
    with torch.no_grad():
        out = hf.generate(ids[None], max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
        seq = out.sequences[0]
        got, _ = paged_logits(ours, seq[:-1], prefill=len(ids))
    torch.testing.assert_close(got[len(ids) - 1 :], torch.cat(out.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe", "qwen3_5"])
def test_packed_chunked_prefill_matches_hf(hybrid, model_type):
    """Two requests packed in each forward, each prompt in two chunks: the state carried in its own slot."""
    path = hybrid(model_type)
    ours, _ = load_model(path)
    hf = load_hf(path)
    a, b = ids_for(ours.cfg, 9, seed=4), ids_for(ours.cfg, 11, seed=5)
    _, kv = kv_for(ours)
    state = GDNStatePool.allocate(ours.cfg, 4)
    tables = torch.tensor([[1, 2, 3, -1], [4, 5, 6, 7]], dtype=I32)
    with torch.no_grad():
        c1 = cache(ours, kv, state, [0, 3], [-1] * 5 + [0] + [-1] * 4 + [3])
        h1 = ours.forward_main(torch.cat([a[:6], b[:5]]), meta(torch.cat([torch.arange(6), torch.arange(5)]), [6, 5],
                                                               [6, 5], tables), c1)  # fmt: skip
        c2 = cache(ours, kv, state, [0, 3], [-1] * 9)
        h2 = ours.forward_main(torch.cat([a[6:], b[5:]]), meta(torch.cat([torch.arange(6, 9), torch.arange(5, 11)]),
                                                               [3, 6], [9, 11], tables), c2)  # fmt: skip
        torch.testing.assert_close(ours.compute_logits(torch.cat([h1[:6], h2[:3]])), hf(a[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
        torch.testing.assert_close(ours.compute_logits(torch.cat([h1[6:], h2[3:]])), hf(b[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


class ReferenceHybridMTP(torch.nn.Module):
    """The MTP module from transformers' own classes: fc(cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)]) ->
    the family's decoder layer (full attention, MoE) -> norm -> the main lm_head (all norms transformers' own
    zero-centred RMSNorm)."""

    def __init__(self, hf, path) -> None:
        super().__init__()
        from safetensors.torch import load_file

        text = hf_text_model(hf)
        cfg = text.config.__class__(**{**text.config.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
        cfg._attn_implementation = "eager"
        own = {k[4:]: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith("mtp.")}
        layer = {k[len("layers.0.") :]: v for k, v in own.items() if k.startswith("layers.0.")}
        e = getattr(cfg, "num_experts", 0)  # dense Qwen3.5: a plain MLP
        if e:
            layer["mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([layer.pop(f"mlp.experts.{i}.gate_proj.weight"), layer.pop(f"mlp.experts.{i}.up_proj.weight")])
                 for i in range(e)])  # fmt: skip
            layer["mlp.experts.down_proj"] = torch.stack([layer.pop(f"mlp.experts.{i}.down_proj.weight")
                                                          for i in range(e)])  # fmt: skip
        self.block = type(text.layers[0])(cfg, 0).eval()
        self.block.load_state_dict(layer, strict=True)
        norm_cls = type(text.norm)
        self.norms = torch.nn.ModuleDict({n: norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps) for n in
                                          ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})  # fmt: skip
        for n, norm in self.norms.items():
            norm.weight.data.copy_(own[f"{n}.weight"])
        self.fc, self.hf, self.text = own["fc.weight"], hf, text

    def forward(self, hidden, token_ids, positions):  # [1, S, H] post-final-norm, [1, S], [1, S]
        e = self.norms["pre_fc_norm_embedding"](self.text.embed_tokens(token_ids))
        x = torch.cat([e, self.norms["pre_fc_norm_hidden"](hidden)], -1) @ self.fc.T
        s = x.shape[1]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        x = self.block(x, attention_mask=mask, position_embeddings=self.text.rotary_emb(x, positions))
        return self.hf.lm_head(self.norms["norm"](x))


def hf_hidden(hf, ids):
    """transformers' post-final-norm hidden of every position (the MTP input), captured at the final norm."""
    seen = []
    handle = hf_text_model(hf).norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        hf(ids[None])
    finally:
        handle.remove()
    return seen[0]


def reference_drafts(path, ids):
    hf = load_hf(path)
    ref = ReferenceHybridMTP(hf, path)
    n = len(ids)
    with torch.no_grad():
        return ref(hf_hidden(hf, ids)[:, : n - 1], ids[None, 1:], torch.arange(n - 1)[None])[0]


def draft_logits(ours, ids, poison_state: bool = False):
    """Prefill, then draft depth 0 position by position over (h_p, t_{p+1}). poison_state: NaN in every GDN state
    slot before the drafts (the MTP layer must not read them)."""
    _, kv = kv_for(ours)
    state = GDNStatePool.allocate(ours.cfg, 2)
    n, table = len(ids), torch.arange(1, 9, dtype=I32)[None]
    hidden = ours.forward_main(ids, meta(torch.arange(n), [n], [n], table), cache(ours, kv, state, [0], [-1] * n))
    if poison_state:
        state.conv.fill_(float("nan"))
        state.ssm.fill_(float("nan"))
    rows = [ours.forward_draft(hidden[p : p + 1], ids[p + 1 : p + 2], torch.tensor([p]), torch.tensor([1], dtype=I32),
                               table, kv)[1] for p in range(n - 1)]  # fmt: skip
    return torch.cat(rows)


@pytest.mark.parametrize("model_type", TYPES)
def test_mtp_draft_logits_match_reference_from_transformers_layers(hybrid, model_type):
    path = hybrid(model_type)
    ours, _ = load_model(path)
    ours.fuse()
    ids = ids_for(ours.cfg, 10, seed=7)
    with torch.no_grad():
        got = draft_logits(ours, ids)
    expected = reference_drafts(path, ids)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_text"])
def test_commit_pass_and_drafts_need_no_gdn_state(hybrid, model_type):
    """The commit pass and the draft loop take only the paged KV (the MTP layer is full attention): with every GDN
    state slot poisoned with NaN after the main forward, commit rows 0..n-3 then draft at n-2 == the all-draft path."""
    ours, _ = load_model(hybrid(model_type))
    ours.fuse()
    ids = ids_for(ours.cfg, 11, seed=9)
    n, table = len(ids), torch.arange(1, 9, dtype=I32)[None]
    with torch.no_grad():
        expected = draft_logits(ours, ids)
        torch.testing.assert_close(draft_logits(ours, ids, poison_state=True), expected, atol=0, rtol=0)
        _, kv = kv_for(ours)
        state = GDNStatePool.allocate(ours.cfg, 2)
        hidden = ours.forward_main(ids, meta(torch.arange(n), [n], [n], table), cache(ours, kv, state, [0], [-1] * n))
        state.conv.fill_(float("nan"))
        state.ssm.fill_(float("nan"))
        written = ours.forward_commit(hidden[: n - 2], ids[1 : n - 1], torch.tensor([n - 2], dtype=I32),
                                      torch.tensor([0], dtype=I32), table, kv)  # fmt: skip
        assert int(written) == n - 2
        _, logits = ours.forward_draft(hidden[n - 2 : n - 1], ids[n - 1 :], torch.tensor([n - 2]),
                                       torch.tensor([1], dtype=I32), table, kv)  # fmt: skip
    torch.testing.assert_close(logits[0], expected[n - 2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("plant", ["norm_not_zero_centred", "dropped_conv_state", "state_slot_off_by_one"])
def test_parity_fails_against_a_planted_bug(hybrid, plant, monkeypatch):
    """Each planted bug moves the decode logits past the 1e-4 tolerance: the parity test above can fail."""
    path = hybrid("qwen3_next")
    if plant == "norm_not_zero_centred":
        monkeypatch.setattr(ZeroCentredRMSNorm, "forward", lambda self, x: torch.nn.functional.rms_norm(
            x, self.weight.shape, self.weight, self.eps))  # fmt: skip
    elif plant == "dropped_conv_state":
        real = GatedDeltaNet.forward

        def no_conv_carry(self, x, meta, cache):
            cache.state.conv[self.state_index].zero_()  # every forward starts its conv window from zeros
            return real(self, x, meta, cache)

        monkeypatch.setattr(GatedDeltaNet, "forward", no_conv_carry)
    ours, _ = load_model(path)
    ids = ids_for(ours.cfg)
    with torch.no_grad():
        expected = load_hf(path)(ids[None]).logits[0]
        if plant == "state_slot_off_by_one":  # decode steps read the slot next to the one the prefill wrote
            _, kv = kv_for(ours)
            state = GDNStatePool.allocate(ours.cfg, 4)
            table = torch.arange(1, 9, dtype=I32)[None]
            ours.forward_main(ids[:10], meta(torch.arange(10), [10], [10], table),
                              cache(ours, kv, state, [1], [-1] * 9 + [1]))  # fmt: skip
            got = ours.compute_logits(ours.forward_main(ids[10:11], meta([10], [1], [11], table),
                                                        cache(ours, kv, state, [2], [2])))  # fmt: skip
            diff = (got[0] - expected[10]).abs().max()
        else:
            got, _ = paged_logits(ours, ids, prefill=10)
            diff = (got - expected).abs().max()
    assert diff > 1e-3, f"planting {plant} left the logits within {diff:.1e}: the parity test could not fail"


def test_hybrid_config_import_and_refusals(hybrid):
    hf = json.loads((hybrid("qwen3_5_moe") / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.num_nextn_predict_layers == 1
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    text = hf["text_config"]
    bad = {
        "layer_types must list 4 entries": {**text, "layer_types": ["linear_attention"] * 3},
        "num_experts=0": {**text, "num_experts": 0},
        "mtp_num_hidden_layers=2 is not supported": {**text, "mtp_num_hidden_layers": 2},
        "mtp_use_dedicated_embeddings=true is not supported": {**text, "mtp_use_dedicated_embeddings": True},
        "rope type 'yarn' is not supported": {**text, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
        "linear_num_value_heads=3 must be a multiple": {**text, "linear_num_value_heads": 3},
    }
    for message, text_cfg in bad.items():
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf_dict({**hf, "text_config": text_cfg})
    with pytest.raises(ConfigError, match="needs a text_config object"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe"})


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe"])
def test_fp8_release_imports_within_e4m3_rounding(hybrid, model_type, tmp_path):
    """The FP8 release format (float8_e4m3fn projections + 128x128 `weight_scale_inv`, Qwen's extra
    `modules_to_not_convert`) goes through the generic FP8 import: every projection within e4m3's rounding of the
    float checkpoint, everything else exact."""
    from models.testing import quantize_checkpoint_fp8

    quantize_checkpoint_fp8(hybrid(model_type), tmp_path / "fp8")
    hf = json.loads((tmp_path / "fp8" / "config.json").read_text())
    hf["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(hf))
    ref, q = load_model(hybrid(model_type))[0].state_dict(), load_model(tmp_path / "fp8")[0].state_dict()
    quantized = [n for n, t in ref.items() if not torch.equal(t, q[n])]
    assert any("linear_attn.in_proj" in n for n in quantized) and any("mtp.0.block" in n for n in quantized)
    for name, t in ref.items():
        assert (t - q[name]).abs().max() <= t.abs().max() / 16 + 1e-6, name
        if name not in quantized:
            continue
        assert "norm" not in name and not name.endswith(("A_log", "dt_bias", "conv1d.weight", "embed_tokens.weight",
                                                         "lm_head.weight", "mlp.gate.weight")), name  # fmt: skip


def test_tied_embeddings_match_hf(tmp_path):
    """Small Qwen3.5 releases tie lm_head to the embedding (save_pretrained then writes no lm_head.weight)."""
    make_hybrid_checkpoint(tmp_path, "qwen3_5_text", seed=3, tie_word_embeddings=True)
    ours, _ = load_model(tmp_path)
    assert ours.cfg.tie_word_embeddings and torch.equal(ours.lm_head.weight, ours.embed_tokens.weight)
    ids = ids_for(ours.cfg)
    with torch.no_grad():
        got, _ = paged_logits(ours, ids, prefill=10)
        torch.testing.assert_close(got, load_hf(tmp_path)(ids[None]).logits[0], atol=1e-4, rtol=1e-4)

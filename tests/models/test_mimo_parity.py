"""MiMo (`MiMoForCausalLM`: Qwen2 trunk + `model.mtp_layers.{j}.*`) parity.

transformers has no MiMo class, and MiMo's trunk is exactly Qwen2, so the main model's reference is transformers'
`Qwen2ForCausalLM` loading the MiMo checkpoint (it drops `model.mtp_layers.*`). The MTP reference is assembled from
transformers' own `Qwen2DecoderLayer` and `Qwen2RMSNorm` as vLLM's `mimo_mtp.py` wires them: hidden first, the
main model's pre-final-norm hidden, final_layernorm, the shared lm_head. Checkpoints: models/testing.py
`make_mimo_checkpoint` (transformers' save_pretrained + the released MTP tensor names).
"""

from __future__ import annotations

import json

import pytest
import torch

from models.checkpoint import load_model
from models.config import ConfigError, ModelConfig
from models.mimo import MiMoMTPModel, MiMoMTPModule
from models.testing import make_mimo_checkpoint
from tests.models.test_mla_parity import draft_logits, ids_for, kv_for, meta, paged_logits

transformers = pytest.importorskip("transformers")

I32 = torch.int32


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    made: dict = {}

    def get(name: str = "base"):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"mimo_{name}")
            overrides = {"tie_word_embeddings": True} if name == "tied" else {}
            make_mimo_checkpoint(made[name], seed=1, **overrides)
        return made[name]

    return get


def load_hf(path):
    return transformers.Qwen2ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


class ReferenceMiMoMTP(torch.nn.Module):
    """MiMo's MTP layer from transformers' own Qwen2 classes: input_proj(cat[hidden_layernorm(h),
    token_layernorm(emb)]) -> Qwen2DecoderLayer -> final_layernorm -> lm_head."""

    def __init__(self, hf, path, j: int = 0) -> None:
        super().__init__()
        from safetensors.torch import load_file
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

        cfg = hf.config
        cfg._attn_implementation = "eager"
        prefix = f"model.mtp_layers.{j}."
        own = {k[len(prefix) :]: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith(prefix)}
        self.norms = torch.nn.ModuleDict({n: Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for n in
                                          ("token_layernorm", "hidden_layernorm", "final_layernorm")})  # fmt: skip
        for n, norm in self.norms.items():
            norm.weight.data.copy_(own.pop(f"{n}.weight"))
        self.input_proj = own.pop("input_proj.weight")
        self.block = Qwen2DecoderLayer(cfg, 0).eval()
        self.block.load_state_dict(own, strict=True)
        self.hf = hf

    def forward(self, prenorm_hidden, token_ids, positions):  # [1, S, H], [1, S], [1, S]
        e = self.norms["token_layernorm"](self.hf.model.embed_tokens(token_ids))
        x = torch.cat([self.norms["hidden_layernorm"](prenorm_hidden), e], -1) @ self.input_proj.T
        s = x.shape[1]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        x = self.block(x, attention_mask=mask, position_embeddings=self.hf.model.rotary_emb(x, positions))
        return self.hf.lm_head(self.norms["final_layernorm"](x))


def hf_prenorm_hidden(hf, ids):
    """The main model's hidden before model.norm (what MiMo's MTP takes), captured at the norm's input."""
    seen = []
    handle = hf.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    try:
        hf(ids[None])
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("name", ["base", "tied"])
@pytest.mark.parametrize("layout", ["fused", "unfused"])
def test_main_logits_match_hf_qwen2_prefill_and_decode(mimo, name, layout):
    path = mimo(name)
    ours, _ = load_model(path)
    assert isinstance(ours, MiMoMTPModel) and ours.cfg.attention_bias and ours.cfg.rotary_dim == ours.cfg.head_dim
    if layout == "fused":
        ours.fuse()
    ids = ids_for(ours.cfg)
    with torch.no_grad():
        expected = load_hf(path)(ids[None]).logits[0]
        got = paged_logits(ours, ids, prefill=10)
    assert expected.abs().max() > 0.1, "logits this small would hide a wrong formula"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_packed_chunked_requests_match_hf(mimo):
    path = mimo()
    ours, _ = load_model(path)
    ours.fuse()
    hf = load_hf(path)
    a, b = ids_for(ours.cfg, 9, seed=4), ids_for(ours.cfg, 11, seed=5)
    _, kv = kv_for(ours)
    tables = torch.tensor([[1, 2, 3, -1], [4, 5, 6, 7]], dtype=I32)
    with torch.no_grad():
        h1 = ours.forward_main(torch.cat([a[:6], b[:5]]), meta(torch.cat([torch.arange(6), torch.arange(5)]), [6, 5],
                                                               [6, 5], tables), kv)  # fmt: skip
        h2 = ours.forward_main(torch.cat([a[6:], b[5:]]), meta(torch.cat([torch.arange(6, 9), torch.arange(5, 11)]),
                                                               [3, 6], [9, 11], tables), kv)  # fmt: skip
        torch.testing.assert_close(ours.compute_logits(torch.cat([h1[:6], h2[:3]])), hf(a[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
        torch.testing.assert_close(ours.compute_logits(torch.cat([h1[6:], h2[3:]])), hf(b[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


def reference_draft_logits(path, ids):
    hf = load_hf(path)
    ref = ReferenceMiMoMTP(hf, path)
    n = len(ids)
    with torch.no_grad():
        hidden = hf_prenorm_hidden(hf, ids)
        return ref(hidden[:, : n - 1], ids[None, 1:], torch.arange(n - 1)[None])[0]


@pytest.mark.parametrize("layout", ["fused", "unfused"])
def test_mtp_draft_logits_match_reference_from_transformers_layers(mimo, layout):
    path = mimo()
    ours, _ = load_model(path)
    if layout == "fused":
        ours.fuse()
    ids = ids_for(ours.cfg, 10, seed=7)
    with torch.no_grad():
        got = draft_logits(ours, ids)
    torch.testing.assert_close(got, reference_draft_logits(path, ids), atol=1e-4, rtol=1e-4)


def test_forward_train_equals_paged_forward(mimo):
    ours, _ = load_model(mimo())
    ids = ids_for(ours.cfg, 12, seed=6)
    with torch.no_grad():
        logits, mtp_logits = ours.forward_train(ids[None])
        torch.testing.assert_close(logits[0], paged_logits(ours, ids, prefill=12), atol=1e-4, rtol=1e-4)
        assert mtp_logits is not None
        torch.testing.assert_close(mtp_logits[0], draft_logits(ours, ids), atol=1e-4, rtol=1e-4)


def test_commit_pass_then_draft_matches(mimo):
    """Commit rows 0..n-3 (K/V only, pre-norm main hiddens, hidden-first fuse), then draft at n-2: equals the
    all-draft path's last row."""
    ours, _ = load_model(mimo())
    ours.fuse()
    ids = ids_for(ours.cfg, 11, seed=9)
    n, table = len(ids), torch.arange(1, 9, dtype=I32)[None]
    with torch.no_grad():
        expected = draft_logits(ours, ids)[n - 2]
        _, kv = kv_for(ours)
        hidden = ours.forward_main(ids, meta(torch.arange(n), [n], [n], table), kv)
        written = ours.forward_commit(hidden[: n - 2], ids[1 : n - 1], torch.tensor([n - 2], dtype=I32),
                                      torch.tensor([0], dtype=I32), table, kv)  # fmt: skip
        assert int(written) == n - 2
        _, logits = ours.forward_draft(hidden[n - 2 : n - 1], ids[n - 1 :], torch.tensor([n - 2]),
                                       torch.tensor([1], dtype=I32), table, kv)  # fmt: skip
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("plant", ["embedding_first", "postnorm_hidden"])
def test_mtp_parity_fails_against_a_planted_bug(mimo, plant, monkeypatch):
    """The draft parity test can fail: GLM's embedding-first concatenation, or the post-final-norm hidden."""
    if plant == "embedding_first":
        monkeypatch.setattr(MiMoMTPModule, "fuse", lambda self, e, h: self.eh_proj(torch.cat([self.enorm(e),
                                                                                              self.hnorm(h)], -1)))  # fmt: skip
    else:
        monkeypatch.setattr(MiMoMTPModel, "forward_main", lambda self, ids, m, kv: self.norm(
            super(MiMoMTPModel, self).forward_main(ids, m, kv)))  # fmt: skip
    path = mimo()
    ours, _ = load_model(path)
    ids = ids_for(ours.cfg, 10, seed=7)
    with torch.no_grad():
        diff = (draft_logits(ours, ids) - reference_draft_logits(path, ids)).abs().max()
    assert diff > 1e-3, f"planting {plant} left the drafts within {diff:.1e}: the parity test could not fail"


def test_mimo_config_refusals(mimo):
    hf = json.loads((mimo() / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.num_nextn_predict_layers, cfg.attention_bias, cfg.partial_rotary_factor) == (1, True, 1.0)
    assert not cfg.has_moe
    with pytest.raises(ConfigError, match="use_sliding_window=true is not supported for mimo"):
        ModelConfig.from_hf_dict({**hf, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="layer_types must all be 'full_attention'"):
        ModelConfig.from_hf_dict({**hf, "layer_types": ["full_attention", "sliding_attention"]})

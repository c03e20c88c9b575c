"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM` + three MTP modules at `model.mtp.layers.{j}.*`) parity, fp32, 1e-4.

Main model: transformers' own `MiMoV2FlashForCausalLM` (eager attention with sinks, sliding-window masks) over
prefill, decode and packed chunks crossing the window (8 keys in models/testing_mimo_v2.py). MTP modules: a
reference assembled from transformers' `MiMoV2FlashDecoderLayer` (sliding window + sinks, dense MLP),
`MiMoV2FlashRMSNorm` and the main model's rotary embedding, wired as vLLM's mimo_v2_flash_mtp.py (embedding first,
the main model's post-final-norm hidden, final_layernorm, the shared lm_head), one check per module.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models.checkpoint import load_model
from models.config import ConfigError, ModelConfig
from models.mimo_v2 import MiMoV2MTPModel
from models.testing_mimo_v2 import make_mimo_v2_checkpoint
from tests.models.test_mla_parity import ids_for, kv_for, meta, paged_logits

transformers = pytest.importorskip("transformers")

I32 = torch.int32
N = 22  # > 2 windows of 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2")
    make_mimo_v2_checkpoint(path, seed=1)
    return path


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.MiMoV2FlashForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    model, _ = load_model(checkpoint)
    assert isinstance(model, MiMoV2MTPModel) and model.cfg.num_mtp_modules == 3
    return model


def test_main_logits_match_hf_prefill_and_decode(ours, hf):
    ids = ids_for(ours.cfg, N)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        got = paged_logits(ours, ids, prefill=10)
    assert expected.abs().max() > 0.1, "logits this small would hide a wrong formula"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_packed_chunked_requests_match_hf(ours, hf):
    """Two requests packed per forward, in chunks that cross the window and block boundaries mid-block."""
    a, b = ids_for(ours.cfg, 17, seed=4), ids_for(ours.cfg, 21, seed=5)
    _, kv = kv_for(ours)
    tables = torch.tensor([[1, 2, 3, 4, 5, -1], [6, 7, 8, 9, 10, 11]], dtype=I32)
    cuts = [(0, 6, 0, 5), (6, 9, 5, 14), (9, 17, 14, 21)]  # [a0, a1) and [b0, b1) per forward
    outs: tuple[list, list] = ([], [])
    with torch.no_grad():
        for a0, a1, b0, b1 in cuts:
            pos = torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)])
            h = ours.forward_main(torch.cat([a[a0:a1], b[b0:b1]]), meta(pos, [a1 - a0, b1 - b0], [a1, b1], tables), kv)
            outs[0].append(h[: a1 - a0])
            outs[1].append(h[a1 - a0 :])
        for ids, hidden in zip((a, b), outs, strict=True):
            torch.testing.assert_close(ours.compute_logits(torch.cat(hidden)), hf(ids[None]).logits[0], atol=1e-4,
                                       rtol=1e-4)  # fmt: skip


class ReferenceMTP(torch.nn.Module):
    """MTP module j from transformers' classes: eh_proj(cat[enorm(emb), hnorm(h)]) -> MiMoV2FlashDecoderLayer
    (sliding_attention, dense) -> final_layernorm -> lm_head."""

    def __init__(self, hf, path, j: int) -> None:
        super().__init__()
        from safetensors.torch import load_file
        from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashDecoderLayer, MiMoV2FlashRMSNorm

        cfg = copy.deepcopy(hf.config)
        cfg._attn_implementation = "eager"
        cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, ["sliding_attention"], ["dense"]
        prefix = f"model.mtp.layers.{j}."
        own = {
            k[len(prefix) :]: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith(prefix)
        }
        self.norms = torch.nn.ModuleDict({n: MiMoV2FlashRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
                                          for n in ("enorm", "hnorm", "final_layernorm")})  # fmt: skip
        for n, norm in self.norms.items():
            norm.weight.data.copy_(own.pop(f"{n}.weight"))
        self.eh_proj = own.pop("eh_proj.weight")
        renamed = {k.replace("attention_sink_bias", "sinks").replace("pre_mlp_layernorm", "post_attention_layernorm"): v
                   for k, v in own.items()}  # fmt: skip
        self.block = MiMoV2FlashDecoderLayer(cfg, 0).eval()
        self.block.load_state_dict(renamed, strict=True)
        self.window, self.hf = cfg.sliding_window, hf

    def forward(self, hidden, token_ids):  # [1, S, H] post-final-norm main hidden, [1, S]
        s = hidden.shape[1]
        x = torch.cat([self.norms["enorm"](self.hf.model.embed_tokens(token_ids)), self.norms["hnorm"](hidden)], -1)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        mask = torch.where((j <= i) & (j > i - self.window), 0.0, float("-inf"))[None, None]
        rope = self.hf.model.rotary_emb(x, torch.arange(s)[None], "sliding_attention")
        x = self.block(x @ self.eh_proj.T, attention_mask=mask, position_embeddings=rope)
        return self.hf.lm_head(self.norms["final_layernorm"](x))


def module_draft_logits(ours, ids: torch.Tensor, j: int) -> torch.Tensor:
    """Our paged MTP module j: prefill, then one draft row per position p over (h_p, t_{p+1})."""
    _, kv = kv_for(ours)
    n, table = len(ids), torch.arange(1, 9, dtype=I32)[None]
    hidden = ours.forward_main(ids, meta(torch.arange(n), [n], [n], table), kv)
    rows = [ours.forward_draft(hidden[p : p + 1], ids[p + 1 : p + 2], torch.tensor([p]), torch.tensor([1], dtype=I32),
                               table, kv, mtp_index=j)[1] for p in range(n - 1)]  # fmt: skip
    return torch.cat(rows)


@pytest.mark.parametrize("j", [0, 1, 2])
def test_each_mtp_module_matches_reference_from_transformers_layers(ours, hf, checkpoint, j):
    ids = ids_for(ours.cfg, 20, seed=7)
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states[-1]  # post-final-norm
        expected = ReferenceMTP(hf, checkpoint, j)(hidden[:, :-1], ids[None, 1:])[0]
        got = module_draft_logits(ours, ids, j)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_commit_pass_writes_every_module_then_draft_matches(ours):
    """Commit rows 0..n-3 (every module's plane), then draft at n-2 with module 2: equals its all-draft row."""
    ids = ids_for(ours.cfg, 19, seed=9)
    n, table = len(ids), torch.arange(1, 9, dtype=I32)[None]
    with torch.no_grad():
        expected = module_draft_logits(ours, ids, 2)[n - 2]
        _, kv = kv_for(ours)
        hidden = ours.forward_main(ids, meta(torch.arange(n), [n], [n], table), kv)
        written = ours.forward_commit(hidden[: n - 2], ids[1 : n - 1], torch.tensor([n - 2], dtype=I32),
                                      torch.tensor([0], dtype=I32), table, kv)  # fmt: skip
        assert int(written) == n - 2
        _, logits = ours.forward_draft(hidden[n - 2 : n - 1], ids[n - 1 :], torch.tensor([n - 2]),
                                       torch.tensor([1], dtype=I32), table, kv, mtp_index=2)  # fmt: skip
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("plant", ["no_window", "no_sinks", "module_0_weights"])
def test_parity_fails_against_a_planted_bug(ours, hf, checkpoint, plant):
    """The tests above can fail: main logits without the window or the sinks, module 2 drafted with module 0."""
    ids = ids_for(ours.cfg, N)
    attn = ours.layers[1].self_attn
    saved = (attn.window, attn.sinks.data.clone())
    try:
        with torch.no_grad():
            if plant == "module_0_weights":
                expected = ReferenceMTP(hf, checkpoint, 2)(hf(ids[None], output_hidden_states=True).hidden_states[-1][
                    :, :-1], ids[None, 1:])[0]  # fmt: skip
                got = module_draft_logits(ours, ids, 0)
            else:
                attn.window = 0 if plant == "no_window" else attn.window
                if plant == "no_sinks":
                    attn.sinks.data.fill_(-1e4)
                expected, got = hf(ids[None]).logits[0], paged_logits(ours, ids, prefill=10)
    finally:
        attn.window, attn.sinks.data = saved[0], saved[1]
    assert (got - expected).abs().max() > 1e-3, f"planting {plant} left the logits within 1e-3"


def test_config_import_and_refusals(checkpoint):
    import json

    hf_cfg = json.loads((checkpoint / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf_cfg)
    assert (cfg.sliding_window, cfg.swa_num_key_value_heads, cfg.v_head_dim, cfg.first_k_dense_replace) == (8, 2, 8, 1)
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert (
        ModelConfig.from_hf_dict({**hf_cfg, "sliding_window": None, "sliding_window_size": 128}).sliding_window == 129
    )
    with pytest.raises(ConfigError, match="interleaves dense and sparse"):
        ModelConfig.from_hf_dict({**hf_cfg, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    with pytest.raises(ConfigError, match="swa_num_key_value_heads=3 is not supported"):
        ModelConfig.from_hf_dict({**hf_cfg, "swa_num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="v_head_dim=16 must be in 1..head_dim=12"):
        ModelConfig.from_hf_dict({**hf_cfg, "v_head_dim": 16})

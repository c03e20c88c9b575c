"""MLA (DeepSeek-V3, GLM-4.7-Flash) parity with Hugging Face transformers, and the MLA config / import checks.

Checkpoints are written by transformers itself (models/testing.py `make_mla_checkpoint`: save_pretrained plus
the MTP module tensors as released mla_checkpoints store them) and loaded by both transformers and our importer.
Our side runs the paged path (latent pool, `mtp::mla_kv_write` / `mtp::mla_paged_attention` CPU ops, absorbed
attention); fp32 logits must agree within 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

from models.checkpoint import load_model
from models.layers import PagedKV, StepMeta
from models.mla import MLAAttention, kv_geometry_fields
from models.testing import MLA_VARIANTS, make_mla_checkpoint
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address

transformers = pytest.importorskip("transformers")

I32 = torch.int32


def load_hf(path):
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    cls = transformers.DeepseekV3ForCausalLM if model_type == "deepseek_v3" else transformers.Glm4MoeLiteForCausalLM
    hf = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{hf.config.num_hidden_layers}\..*"]
    return hf


def kv_for(model, num_blocks=16, block_size=4):
    heads, dim, kind = kv_geometry_fields(model.cfg)
    geom = KVPoolGeometry(model.num_kv_planes, num_blocks, block_size, heads, dim, 0, kind)
    pool = allocate_pool(geom)
    return pool, PagedKV(pool_address(pool), geom)


def meta(positions, q_counts, kv_lens, table) -> StepMeta:
    return StepMeta(torch.as_tensor(positions), torch.tensor(q_counts, dtype=I32), torch.tensor(kv_lens, dtype=I32),
                    table)  # fmt: skip


def paged_logits(ours, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ids[:prefill] in one forward, then decode the rest one token per step; logits of every row."""
    _, kv = kv_for(ours)
    table = torch.arange(1, 9, dtype=I32)[None]
    out = [ours.compute_logits(ours.forward_main(ids[:prefill], meta(torch.arange(prefill), [prefill], [prefill],
                                                                       table), kv))]  # fmt: skip
    for p in range(prefill, len(ids)):
        out.append(ours.compute_logits(ours.forward_main(ids[p : p + 1], meta([p], [1], [p + 1], table), kv)))
    return torch.cat(out)


def ids_for(cfg, n=14, seed=2):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", ["fused", "unfused"])
@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
def test_main_logits_match_hf_prefill_and_decode(mla_checkpoints, variant, layout):
    path = mla_checkpoints(variant)
    ours, _ = load_model(path)
    if layout == "fused":
        ours.fuse()
    ids = ids_for(ours.cfg)
    with torch.no_grad():
        expected = load_hf(path)(ids[None]).logits[0]
        got = paged_logits(ours, ids, prefill=10)
    assert expected.abs().max() > 0.1, "logits this small would hide a wrong formula"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_packed_chunked_requests_match_hf(mla_checkpoints):
    """Two requests packed in one forward, chunks crossing block boundaries mid-block (YaRN variant)."""
    path = mla_checkpoints("dsv3_yarn")
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


@pytest.mark.parametrize("variant", ["dsv3_yarn", "glm_lite"])
def test_forward_train_equals_paged_forward(mla_checkpoints, variant):
    """The decompressed training path (HF's formulation) == the absorbed paged path, main and MTP logits."""
    ours, _ = load_model(mla_checkpoints(variant))
    ids = ids_for(ours.cfg, 12, seed=6)
    with torch.no_grad():
        logits, mtp_logits = ours.forward_train(ids[None])
        torch.testing.assert_close(logits[0].float(), paged_logits(ours, ids, prefill=12), atol=1e-4, rtol=1e-4)
        assert mtp_logits is not None
        expected = draft_logits(ours, ids)
    torch.testing.assert_close(mtp_logits[0].float(), expected, atol=1e-4, rtol=1e-4)


def draft_logits(ours, ids: torch.Tensor) -> torch.Tensor:
    """Our paged MTP: prefill, then draft depth 0 position by position over (h_p, t_{p+1})."""
    _, kv = kv_for(ours)
    n, table = len(ids), torch.arange(1, 9, dtype=I32)[None]
    hidden = ours.forward_main(ids, meta(torch.arange(n), [n], [n], table), kv)
    rows = [ours.forward_draft(hidden[p : p + 1], ids[p + 1 : p + 2], torch.tensor([p]), torch.tensor([1], dtype=I32),
                               table, kv)[1] for p in range(n - 1)]  # fmt: skip
    return torch.cat(rows)


def hf_mtp(hf, ids):
    """transformers' MTP module (what generate(use_mtp=True) drafts with) over pairs (h_p, t_{p+1}) -> logits."""
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel.from_pretrained(hf, device_map={"": "cpu"}).eval()
    hidden = hf(ids[None], output_hidden_states=True).hidden_states[-1]  # post-final-norm
    n = len(ids)
    h = mtp.forward_layer(0, hidden[:, : n - 1], torch.arange(1, n)[None], MtpCache(config=hf.config.get_mtp_config()),
                          input_ids=ids[None, 1:])  # fmt: skip
    return mtp._project_to_logits(h)[0]


@pytest.mark.parametrize("variant", ["dsv3", "dsv3_yarn", "dsv3_no_qlora"])
def test_deepseek_mtp_draft_logits_match_hf(mla_checkpoints, variant):
    path = mla_checkpoints(variant)
    ours, _ = load_model(path)
    ours.fuse()
    ids = ids_for(ours.cfg, 10, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(ours, ids), hf_mtp(load_hf(path), ids), atol=1e-4, rtol=1e-4)


class ReferenceMTP(torch.nn.Module):
    """The MTP layer in plain torch around transformers' own decoder block: cat([enorm(emb), hnorm(h)]) -> eh_proj
    -> block (always MoE) -> shared_head.norm -> the main lm_head."""

    def __init__(self, hf, tensors: dict[str, torch.Tensor], layer: int) -> None:
        super().__init__()
        cfg = hf.config.__class__(**{**hf.config.to_dict(), "mlp_layer_types": ["sparse"]})
        cfg._attn_implementation = "eager"
        self.block = type(hf.model.layers[0])(cfg, 0).eval()
        prefix = f"model.layers.{layer}."
        own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        e = cfg.n_routed_experts
        own["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([own.pop(f"mlp.experts.{i}.gate_proj.weight"), own.pop(f"mlp.experts.{i}.up_proj.weight")])
             for i in range(e)])  # fmt: skip
        own["mlp.experts.down_proj"] = torch.stack([own.pop(f"mlp.experts.{i}.down_proj.weight") for i in range(e)])
        self.enorm, self.hnorm, self.final = (own.pop(f"{n}.weight") for n in ("enorm", "hnorm", "shared_head.norm"))
        self.eh_proj = own.pop("eh_proj.weight")
        for k in ("embed_tokens.weight", "shared_head.head.weight"):
            own.pop(k)
        self.block.load_state_dict(own, strict=True)
        self.hf, self.eps = hf, cfg.rms_norm_eps

    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, hidden, token_ids, positions):  # [1, S, H], [1, S], [1, S]
        x = torch.cat([self.norm(self.hf.model.embed_tokens(token_ids), self.enorm), self.norm(hidden, self.hnorm)], -1)
        x = x @ self.eh_proj.T
        s = x.shape[1]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        x = self.block(x, attention_mask=mask, position_embeddings=self.hf.model.rotary_emb(x, positions))
        return self.hf.lm_head(self.norm(x, self.final))


@pytest.mark.parametrize("variant", ["glm_lite", "glm_lite_qlora_yarn"])
def test_glm_lite_mtp_draft_logits_match_reference(mla_checkpoints, variant):
    """transformers' use_mtp refuses glm4_moe_lite (no num_mtp_layers alias): compare against ReferenceMTP."""
    from safetensors.torch import load_file

    path = mla_checkpoints(variant)
    ours, _ = load_model(path)
    ours.fuse()
    hf = load_hf(path)
    ref = ReferenceMTP(hf, load_file(str(path / "model.safetensors")), hf.config.num_hidden_layers)
    ids = ids_for(ours.cfg, 10, seed=8)
    n = len(ids)
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states[-1]
        expected = ref(hidden[:, : n - 1], ids[None, 1:], torch.arange(n - 1)[None])[0]
        torch.testing.assert_close(draft_logits(ours, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["dsv3_yarn", "glm_lite"])
def test_commit_pass_then_draft_matches(mla_checkpoints, variant):
    """Commit rows 0..n-3 in one latent-only write (k_pe roped inside the op, YaRN scale included), then draft
    at n-2: equals the all-draft path's last row."""
    ours, _ = load_model(mla_checkpoints(variant))
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


def test_deepseek_k1_acceptance_matches_hf_generate_use_mtp(tmp_path):
    """K=1, batch 1: the accepted count of every verify step == what generate(use_mtp=True) accepts.

    A random MTP module agrees with the main model about 1/vocab of the time: an 8-token vocabulary gives
    both accepted and rejected drafts in 30 tokens."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    from runtime.core.sampling import SamplingParams
    from runtime.factory import create_engine

    model_type, overrides = MLA_VARIANTS["dsv3_yarn"]
    make_mla_checkpoint(tmp_path, model_type, seed=3, **{**overrides, "vocab_size": 8})
    path = tmp_path
    hf = load_hf(path)
    matches: list[int] = []
    original = MTPCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    prompt, max_new = ids_for(hf.config, 9, seed=10).tolist(), 30
    MTPCandidateGenerator.update_candidate_strategy = record
    try:
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, use_mtp=True)
    finally:
        MTPCandidateGenerator.update_candidate_strategy = original
    eng = create_engine(checkpoint=path, executor="torch", num_draft_tokens=1, block_size=4, num_blocks=64,
                        max_batch=1, max_num_tokens=64, max_seq_len=128)  # fmt: skip
    ours = eng.generate([prompt], SamplingParams(max_tokens=max_new))[0]
    assert ours.output_ids == hf_out[0, len(prompt) :].tolist()
    hf_steps = matches[1:]  # the first call follows the prefill forward (no draft yet)
    n = min(len(hf_steps), len(ours.accepted_per_step)) - 1  # the last step may be cut by max_new_tokens
    assert n > 5 and 0 < sum(hf_steps[:n]) < n, "a useful check needs both accepted and rejected drafts"
    assert ours.accepted_per_step[:n] == hf_steps[:n]


# --- perturbations: each piece of the MLA math is load-bearing for the parity tests above ---------------


@pytest.mark.parametrize("perturb", ["mscale", "rope_scale", "rope_order"])
def test_parity_fails_when_the_math_is_perturbed(mla_checkpoints, perturb):
    path = mla_checkpoints("dsv3_yarn")
    ours, _ = load_model(path)
    for m in ours.modules():
        if isinstance(m, MLAAttention):
            if perturb == "mscale":  # drop the yarn_apply_mscale softmax correction
                m.scale = (m.nope_dim + m.rope_dim) ** -0.5
            elif perturb == "rope_scale":  # drop YaRN's attention factor on cos/sin
                m.rope_scale, m._rope_key = 1.0, ("perturbed",)
            else:  # forget the import's de-interleave of the rope rows (interleaved pairs read as neox halves)
                order = torch.cat([torch.arange(0, m.rope_dim, 2), torch.arange(1, m.rope_dim, 2)]).argsort()
                w = m.kv_a_proj_with_mqa.weight.data
                w[m.rank :] = w[m.rank :][order]
    ids = ids_for(ours.cfg)
    with torch.no_grad():
        diff = (paged_logits(ours, ids, prefill=10) - load_hf(path)(ids[None]).logits[0]).abs().max()
    assert diff > 1e-3, f"perturbing {perturb} left the logits within {diff:.1e}: the parity test could not fail"

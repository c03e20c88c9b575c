"""Issue 29: the start-up acceptance self-check (runtime/core/self_check.py) on the 2026 MTP families, torch
executor: it stays silent on a correctly wired draft path and reports a draft module fed the wrong hidden state, for
DeepSeek Sparse Attention (GLM-5) and MiMo-V2-Flash.

A random tiny MTP module agrees with the main model by chance only (the check calls it low with or without a bug:
tests/runtime/test_dsa_lossless.py), and a brief distillation does not make it depend on the hidden state (a linear
fit of eh_proj reached 0.51-0.59 agreement, 0.45-0.51 with the hidden state zeroed). So the checkpoints are edited
to make the draft exact and carried by the hidden state alone: every main layer's output projections (o_proj,
down_proj) are zeroed, so the main model is a bigram B(t) = argmax lm_head(h(t)) with h(t) = norm(emb(t)); the MTP
block's are zeroed too (an identity block), and eh_proj reads only hnorm(h_p), mapping it exactly (vocab < hidden)
to emb(B(t_p)) / rms, which `shared_head.norm` (the main norm's weight) and lm_head turn into B(B(t_p)) = t_{p+2}.
The engine's real draft path (commit pass, hidden-state hand-off, draft loop, MTP KV and indexer writes) runs
unchanged; a module fed the wrong hidden state (zeros, tests/runtime/test_acceptance_guard.py's plant) drafts a
constant. What this cannot show: GLM-5's MTP fed the main model's top-k (tests/models/test_dsa_parity.py) changes
nothing when the block is an identity; see docs/MODELS.md."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import load_model
from models.testing_dsa import DSA_VARIANTS, make_dsa_checkpoint
from models.testing_mimo_v2 import make_mimo_v2_checkpoint
from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.engine import LLMEngine
from runtime.core.self_check import start_up_check
from runtime.executors.torch_executor import TorchExecutor
from runtime.factory import load_tokenizer
from tests.runtime.test_acceptance_guard import WrongDraftInput

VOCAB = 12


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def make_exact_draft(path, num_layers: int, mtps: list[str], final_norm: str) -> None:
    """Edit the checkpoint at `path` as the module docstring says; `mtps`: every MTP module's tensor prefix (a
    chained depth feeds the module its predecessor's output after `final_norm`: h(B(t)), so it stays exact)."""
    t = load_file(str(path / "model.safetensors"))
    main = re.compile(rf"model\.layers\.({'|'.join(map(str, range(num_layers)))})\.")
    for name in t:
        if (main.match(name) or name.startswith(tuple(mtps))) and re.search(r"o_proj|down_proj", name):
            t[name] = torch.zeros_like(t[name])  # no layer writes the residual: h(t) = norm(emb(t))
    emb, w = t["model.embed_tokens.weight"], t["model.norm.weight"]
    hidden = w * rms(emb)  # h(t), the post-norm hidden the MTP module receives, for every token t
    bigram = (hidden @ t["lm_head.weight"].T).argmax(-1)
    for mtp in mtps:
        hn = t[f"{mtp}hnorm.weight"] * rms(hidden)
        m = rms(emb[bigram]).T @ torch.linalg.pinv(hn.T)  # M hn(t) = emb(B(t)) / rms, exactly
        t[f"{mtp}eh_proj.weight"] = torch.cat([torch.zeros_like(m), m], 1).contiguous()  # [enorm(emb) | hnorm(h)]
        t[f"{mtp}{final_norm}.weight"] = w.clone()
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})


def engine_with_plant(path) -> tuple[LLMEngine, WrongDraftInput]:
    model, _ = load_model(path)
    cfg = RuntimeConfig(max_batch=4, max_num_tokens=64, max_seq_len=160, block_size=16, num_blocks=64,
                        num_draft_tokens=2, enable_prefix_caching=False)  # fmt: skip
    plant = WrongDraftInput(TorchExecutor(model, cfg.num_blocks, cfg.block_size, num_draft_tokens=2))
    return LLMEngine(plant, model.cfg, cfg, load_tokenizer(path)), plant


def dsa(path) -> None:
    model_type, overrides = DSA_VARIANTS["glm5"]
    hf = make_dsa_checkpoint(path, model_type, seed=6, **{**overrides, "vocab_size": VOCAB})
    make_exact_draft(path, hf["num_hidden_layers"], [f"model.layers.{hf['num_hidden_layers']}."], "shared_head.norm")


def mimo_v2(path) -> None:
    hf = make_mimo_v2_checkpoint(path, seed=6, vocab_size=VOCAB, num_mtp=2)  # K=2: depth d runs module d
    make_exact_draft(path, hf["num_hidden_layers"], ["model.mtp.layers.0.", "model.mtp.layers.1."], "final_layernorm")


@pytest.mark.parametrize("make", [dsa, mimo_v2])
def test_self_check_reports_a_draft_module_fed_the_wrong_hidden_state(make, tmp_path, capsys):
    make(tmp_path)
    engine, plant = engine_with_plant(tmp_path)
    capsys.readouterr()  # the checkpoint writer's progress bar
    good = start_up_check(engine, "warn", "mtp-run")
    assert good is not None and good.verdict == "ok" and capsys.readouterr().err == "", good  # silent when correct
    plant.on = "hidden"
    bad = start_up_check(engine, "warn", "mtp-run")
    err = capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^mtp-run: acceptance self-check: MTP acceptance 0\.\d\d"):
        start_up_check(engine, "strict", "mtp-run")
    assert bad is not None and bad.verdict == "low" and bad.measured < good.measured / 2, (good, bad)
    assert err.count("\n") == 1 and "implausibly low" in err and f"{bad.measured:.2f}" in err

"""Reproduces docs/MODELS.md "MiMo-V2-Flash: acceptance with three trained modules" (not a test):

    PYTHONPATH=. python tests/runtime/mimo_v2_acceptance_figures.py [steps] [seed] [deepseek|engine]

A tiny random MiMo-V2-Flash main model (models/testing_mimo_v2.py, hidden 64, head_dim 24, vocab 64, window 8) is the
teacher; its three MTP modules are trained briefly, jointly, by self-distillation over windows of the main model's own
greedy continuations of random prompts (targets: the main model's greedy tokens), with one of two objectives:
  deepseek  the DeepSeek-V3 chained MTP objective: module j row p = eh_proj(cat[enorm(emb(t_{p+j+1})),
            hnorm(g^{j-1}_p)]) at position p over its own rows, g^{-1} = the main post-norm hidden (how the released
            modules are trained);
  engine    the chain exactly as the engine drafts it (`Modules.engine_losses`: depth d at position p+d, keys = module
            d's K/V of the committed depth-0 inputs, of the earlier depths' rows and its own; checked by hand equal
            to `MiMoV2MTPModel.forward_draft` after a commit pass within 2e-6).
The modules are transformers' own `MiMoV2FlashDecoderLayer` (sliding window + sinks, dense MLP) plus the norms and
eh_proj, written back in the release's names. Then the engine (torch executor) decodes held-out prompts greedily at
K=3 with `mtp_modules="per-depth"` (depth d runs module d) and `"first"` (module 0 at every depth), and prints the
acceptance per position and the mean tokens per step of each.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models.testing_mimo_v2 import make_mimo_v2_checkpoint
from runtime.core.sampling import SamplingParams
from runtime.factory import create_engine

VOCAB, PROMPT, CONT, DEPTHS = 64, 8, 56, 3


def greedy_windows(hf, n: int, seed: int) -> torch.Tensor:
    """[n, PROMPT + CONT] random prompts and the main model's greedy continuations."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (n, PROMPT), generator=g)
    with torch.no_grad():
        return hf.generate(prompts, max_new_tokens=CONT, min_new_tokens=CONT, do_sample=False)


class Modules(torch.nn.Module):
    """The three MTP modules from transformers' classes, loaded from (and saved back to) the checkpoint."""

    def __init__(self, hf, path: Path) -> None:
        super().__init__()
        from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashDecoderLayer, MiMoV2FlashRMSNorm

        cfg = copy.deepcopy(hf.config)
        cfg._attn_implementation = "eager"
        cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, ["sliding_attention"], ["dense"]
        tensors = load_file(str(path / "model.safetensors"))
        self.layers = torch.nn.ModuleList()
        h = cfg.hidden_size
        for j in range(DEPTHS):
            m = torch.nn.Module()
            m.enorm, m.hnorm, m.final_layernorm = (MiMoV2FlashRMSNorm(h, cfg.rms_norm_eps) for _ in range(3))
            m.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            m.block = MiMoV2FlashDecoderLayer(cfg, 0)
            prefix = f"model.mtp.layers.{j}."
            own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            state = {(k if k.split(".")[0] in ("enorm", "hnorm", "final_layernorm", "eh_proj") else "block." + k)
                     .replace("attention_sink_bias", "sinks").replace("pre_mlp_layernorm", "post_attention_layernorm"): v
                     for k, v in own.items()}  # fmt: skip
            m.load_state_dict(state, strict=True)
            self.layers.append(m)
        self.window, self.hf = cfg.sliding_window, hf

    def losses(self, ids: torch.Tensor) -> list[torch.Tensor]:
        hf = self.hf
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
            g, target = out.hidden_states[-1], out.logits.argmax(-1)  # post-norm hidden; greedy token per position
        emb = hf.model.embed_tokens(ids)
        s, losses = ids.shape[1], []
        for j, m in enumerate(self.layers):
            n = s - j - 1
            x = m.eh_proj(torch.cat([m.enorm(emb[:, j + 1 : j + 1 + n]), m.hnorm(g[:, :n])], -1))
            i, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
            mask = torch.where((k <= i) & (k > i - self.window), 0.0, float("-inf"))[None, None]
            rope = hf.model.rotary_emb(x, torch.arange(n)[None], "sliding_attention")
            g = m.final_layernorm(m.block(x, attention_mask=mask, position_embeddings=rope))
            logits = hf.lm_head(g)  # row p predicts the token at p+j+2: the main model's greedy token at p+j+1
            losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), target[:, j + 1 : j + 1 + n].reshape(-1)))
        return losses

    def engine_losses(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The chained objective as the engine drafts (models/mimo_v2.py, docs/MODELS.md "One module per depth"):
        depth d of base b = p+1 runs module d on (g^{d-1}_p, t_{p+d+1}) at position p+d; its keys are module d's
        K/V of the committed depth-0 inputs (h_q, t_{q+1}) at positions q <= p (the commit pass and depth 0's
        lookahead), of this chain's depth-i inputs at p+i for 0 < i < d (the earlier depths' lookahead writes) and
        of its own row, inside the window."""
        hf = self.hf
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
            h, target = out.hidden_states[-1], out.logits.argmax(-1)
        emb = hf.model.embed_tokens(ids)
        n = ids.shape[1] - DEPTHS  # rows p = 0..n-1: every depth's target inside the window of ids
        rows = torch.arange(n)
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []  # depth-i inputs (hidden, token embedding), i >= 1
        g, losses = h[:, :n], []
        for d, m in enumerate(self.layers):
            x0 = self._fuse(m, emb[:, 1 : n + 1], h[:, :n])  # depth-0 inputs, positions 0..n-1
            keys, values = self._kv(m, x0, rows)
            visible = [(rows[None, :] <= rows[:, None]) & (rows[:, None] + d - rows[None, :] < self.window)]
            if d == 0:
                x, pos = x0, rows
            else:
                for i, (hid, tok) in enumerate(chain, start=1):
                    k, v = self._kv(m, self._fuse(m, tok, hid), rows + i)
                    keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
                    visible.append(torch.eye(n, dtype=torch.bool))
                x, pos = self._fuse(m, emb[:, d + 1 : d + 1 + n], g), rows + d
                k, v = self._kv(m, x, pos)
                keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
                visible.append(torch.eye(n, dtype=torch.bool))
            if d:  # depth 0's inputs are the base keys above
                chain.append((g, emb[:, d + 1 : d + 1 + n]))
            g = self._attend(m, x, pos, keys, values, torch.cat(visible, 1))
            losses.append(F.cross_entropy(hf.lm_head(g).reshape(-1, VOCAB), target[:, d + 1 : d + 1 + n].reshape(-1)))
        return losses

    def _fuse(self, m, tok: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        return m.eh_proj(torch.cat([m.enorm(tok), m.hnorm(hid)], -1))

    def _rope(self, x: torch.Tensor, t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import apply_rotary_pos_emb

        cos, sin = self.hf.model.rotary_emb(x, pos[None], "sliding_attention")
        return apply_rotary_pos_emb(t, t, cos, sin)[0]

    def _kv(self, m, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn, (b, n, _) = m.block.self_attn, x.shape
        hx = m.block.input_layernorm(x)
        k = attn.k_proj(hx).view(b, n, -1, attn.head_dim).transpose(1, 2)
        v = (attn.v_proj(hx).view(b, n, -1, attn.v_head_dim) * attn.v_scale).transpose(1, 2)
        return self._rope(x, k, pos), v

    def _attend(self, m, x, pos, keys, values, visible) -> torch.Tensor:
        """One decoder layer for query rows x at `pos` over the given keys (transformers' eager math with sinks)."""
        attn, (b, n, _) = m.block.self_attn, x.shape
        q = self._rope(x, attn.q_proj(m.block.input_layernorm(x)).view(b, n, -1, attn.head_dim).transpose(1, 2), pos)
        group = q.shape[1] // keys.shape[1]
        scores = q @ keys.repeat_interleave(group, 1).transpose(2, 3) * attn.scaling
        scores = scores.masked_fill(~visible[None, None], float("-inf"))
        sink = attn.sinks.reshape(1, -1, 1, 1).expand(b, -1, n, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        o = (probs @ values.repeat_interleave(group, 1)).transpose(1, 2).reshape(b, n, -1)
        x = x + attn.o_proj(o)
        x = x + m.block.mlp(m.block.post_attention_layernorm(x))
        return m.final_layernorm(x)

    def save(self, path: Path) -> None:
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        for j, m in enumerate(self.layers):
            for k, v in m.state_dict().items():
                name = k.removeprefix("block.").replace("self_attn.sinks", "self_attn.attention_sink_bias")
                tensors[f"model.mtp.layers.{j}.{name.replace('post_attention_layernorm', 'pre_mlp_layernorm')}"] = v
        save_file(tensors, str(file), metadata={"format": "pt"})


def acceptance(path: Path, prompts: list[list[int]], policy: str) -> tuple[list[float], float]:
    engine = create_engine(checkpoint=path, executor="torch", num_draft_tokens=DEPTHS, mtp_modules=policy,
                           block_size=16, num_blocks=256, max_batch=8, max_num_tokens=128, max_seq_len=128)  # fmt: skip
    engine.generate(prompts, SamplingParams(max_tokens=CONT))
    m = engine.metrics
    return list(m.acceptance_rate_per_position), m.mean_acceptance_length


def main(steps: int, seed: int, objective: str) -> None:
    import transformers

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared machine
    path = Path(tempfile.mkdtemp()) / "mimo_v2"
    make_mimo_v2_checkpoint(path, seed=seed, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, head_dim=24,
                            v_head_dim=16)  # fmt: skip
    hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    t0 = time.time()
    train = greedy_windows(hf, 256, seed + 1)
    held_out = greedy_windows(hf, 16, seed + 2)[:, :PROMPT].tolist()
    modules = Modules(hf, path)
    opt = torch.optim.AdamW(modules.layers.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = train[torch.randint(0, len(train), (32,), generator=g)]
        losses = modules.losses(batch) if objective == "deepseek" else modules.engine_losses(batch)
        opt.zero_grad()
        sum(losses).backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: CE per depth {[round(x.item(), 3) for x in losses]}", flush=True)
    print(f"data + training: {time.time() - t0:.0f} s", flush=True)
    modules.save(path)
    for policy in ("per-depth", "first"):
        rates, mean = acceptance(path, held_out, policy)
        print(f"K={DEPTHS} mtp_modules={policy}: acceptance per position {[round(r, 3) for r in rates]}, "
              f"mean tokens per step {mean:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 400, int(args[1]) if len(args) > 1 else 0, args[2] if len(args) > 2 else "deepseek")

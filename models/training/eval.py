"""Measuring the tiny model: the MTP training objective's two losses and the held-out evaluation.

Owns `mtp_losses` (main CE and MTP depth-1 CE of one batch of token windows, plus the logits), MTP greedy
acceptance (how often the MTP draft equals the main model's greedy token, i.e. what greedy speculative decoding
accepts at depth 1), the held-out evaluation windows and `evaluate` (token-weighted held-out losses,
acceptance and top-1 accuracies). models/training/train.py trains with `mtp_losses` and reports `evaluate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.glm4_moe import Glm4MoeMTPModel


def mtp_losses(
    model: Glm4MoeMTPModel, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """window [B, S+1] -> (main CE, MTP CE, main logits [B,S,V], MTP logits [B,S-1,V]).

    Main row p predicts t_{p+1}; MTP row p (h_p paired with t_{p+1}) predicts t_{p+2}.
    """
    inputs = window[:, :-1]
    main_logits, mtp_logits = model.forward_train(inputs)
    assert mtp_logits is not None, "the tiny model must have an MTP module"
    vocab = main_logits.shape[-1]
    main_ce = F.cross_entropy(main_logits.reshape(-1, vocab).float(), window[:, 1:].reshape(-1))
    mtp_ce = F.cross_entropy(mtp_logits.reshape(-1, vocab).float(), window[:, 2:].reshape(-1))
    return main_ce, mtp_ce, main_logits, mtp_logits


def greedy_acceptance(main_logits: torch.Tensor, mtp_logits: torch.Tensor) -> tuple[int, int]:
    """(matches, positions): MTP row p's argmax vs the main model's argmax at row p+1 (both predict t_{p+2})."""
    draft = mtp_logits.argmax(-1)
    target = main_logits[:, 1:].argmax(-1)
    return int((draft == target).sum()), draft.numel()


def eval_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping [N, seq_len+1] windows, evenly spaced over the stream so every held-out file counts."""
    n_avail = (len(stream) - 1) // seq_len
    n = max(1, min(n_avail, max_tokens // seq_len))
    starts = torch.linspace(0, (n_avail - 1) * seq_len, n).long()
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: Glm4MoeMTPModel, windows: torch.Tensor, batch_size: int = 16) -> dict[str, float]:
    """Held-out main CE, MTP CE, greedy acceptance and top-1 accuracies (token-weighted means)."""
    model.eval()
    sums: dict[str, float] = {"main": 0.0, "mtp": 0.0, "accept": 0, "accept_n": 0, "main_acc": 0, "mtp_acc": 0}
    n_main = n_mtp = 0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size]
        main_ce, mtp_ce, main_logits, mtp_logits = mtp_losses(model, w)
        k, n = greedy_acceptance(main_logits, mtp_logits)
        sums["main"] += float(main_ce) * w[:, 1:].numel()
        sums["mtp"] += float(mtp_ce) * w[:, 2:].numel()
        sums["accept"] += k
        sums["accept_n"] += n
        sums["main_acc"] += int((main_logits.argmax(-1) == w[:, 1:]).sum())
        sums["mtp_acc"] += int((mtp_logits.argmax(-1) == w[:, 2:]).sum())
        n_main += w[:, 1:].numel()
        n_mtp += w[:, 2:].numel()
    model.train()
    return {
        "main_loss": sums["main"] / n_main,
        "mtp_loss": sums["mtp"] / n_mtp,
        "mtp_greedy_acceptance": sums["accept"] / sums["accept_n"],
        "main_top1_accuracy": sums["main_acc"] / n_main,
        "mtp_top1_accuracy": sums["mtp_acc"] / n_mtp,
        "tokens": n_main,
    }

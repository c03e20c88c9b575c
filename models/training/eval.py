"""Measuring the shipped models: the depth-1 MTP losses and the held-out evaluation at chained depths.

Owns `mtp_losses` (main CE and MTP depth-1 CE of one batch of token windows, plus the logits), MTP greedy
acceptance (how often the MTP draft equals the main model's greedy token, i.e. what greedy speculative decoding
accepts at depth 1), the held-out evaluation windows and `evaluate` (token-weighted held-out losses, top-1
accuracies and per-depth acceptance, unconditional and conditional, of the chained drafts of
models/training/chained.py). models/training/train.py trains with `chained_losses` and reports `evaluate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.glm4_moe import Glm4MoeMTPModel
from models.training.chained import chain_matches, chained_losses


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
def evaluate(model: Glm4MoeMTPModel, windows: torch.Tensor, depths: int = 1, batch_size: int = 16) -> dict:
    """Held-out losses, top-1 accuracies and greedy draft acceptance at chained depths 1..`depths`.

    Token-weighted means over `windows` [N, S+1]. Acceptance at depth d (rows every depth has):
    unconditional = P(drafts 1..d all equal the main model's greedy tokens), conditional = P(draft d matches |
    drafts 1..d-1 matched) = unconditional[d] / unconditional[d-1]. The chain is teacher-forced: depth j's input
    token is the true t_{p+j}, which is what the draft loop feeds whenever the earlier drafts were accepted and
    the text is the model's own greedy output. Depth-1 numbers keep their old keys (mtp_loss, ...).
    """
    model.eval()
    main_sum = main_acc = 0.0
    n_main = 0
    loss_sum, acc_sum, n_depth = [0.0] * depths, [0.0] * depths, [0] * depths
    chain_hits, n_chain = [0] * depths, 0
    accept1 = accept1_n = 0  # depth 1 over all of its rows (the chained table drops each window's last depths-1)
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size]
        main_ce, ces, main_logits, mtp_logits = chained_losses(model, w, depths)
        main_sum += float(main_ce) * w[:, 1:].numel()
        main_acc += int((main_logits.argmax(-1) == w[:, 1:]).sum())
        n_main += w[:, 1:].numel()
        for j, (ce, lg) in enumerate(zip(ces, mtp_logits, strict=True)):
            target = w[:, j + 2 :]
            loss_sum[j] += float(ce) * target.numel()
            acc_sum[j] += int((lg.argmax(-1) == target).sum())
            n_depth[j] += target.numel()
        k, n = greedy_acceptance(main_logits, mtp_logits[0])
        accept1, accept1_n = accept1 + k, accept1_n + n
        all_match = chain_matches(main_logits, mtp_logits).cumprod(0)  # [depths, B, rows]: drafts 1..d all match
        for j in range(depths):
            chain_hits[j] += int(all_match[j].sum())
        n_chain += all_match[0].numel()
    model.train()
    uncond = [h / n_chain for h in chain_hits]
    cond = [uncond[0]] + [uncond[j] / uncond[j - 1] if uncond[j - 1] else 0.0 for j in range(1, depths)]
    per_depth_loss = [s / n for s, n in zip(loss_sum, n_depth, strict=True)]
    return {
        "main_loss": main_sum / n_main,
        "mtp_loss": per_depth_loss[0],
        "mtp_greedy_acceptance": accept1 / accept1_n,
        "main_top1_accuracy": main_acc / n_main,
        "mtp_top1_accuracy": acc_sum[0] / n_depth[0],
        "tokens": n_main,
        "mtp_loss_per_depth": per_depth_loss,
        "mtp_top1_accuracy_per_depth": [a / n for a, n in zip(acc_sum, n_depth, strict=True)],
        "acceptance_unconditional": uncond,
        "acceptance_conditional": cond,
        "acceptance_positions": n_chain,
    }


def heldout_windows(tok, seq_len: int, max_tokens: int) -> torch.Tensor:
    """The training run's held-out evaluation windows, rebuilt from a checkpoint's own tokenizer."""
    from models.training.data import encode_documents, read_source, split_files, stdlib_files
    from models.training.tokenizer import EOS_TOKEN

    _, heldout = split_files(stdlib_files())
    stream = encode_documents(tok, [read_source(f) for f in heldout], tok.token_to_id(EOS_TOKEN))
    return eval_windows(stream, seq_len, max_tokens)


def main(argv: list[str] | None = None) -> int:
    """`python -m models.training.eval --checkpoint DIR`: re-measure a checkpoint on the held-out split."""
    import argparse
    import json

    from models.checkpoint import CheckpointError, load_model
    from models.training.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--checkpoint", required=True, help="a directory written by models.training.train")
    p.add_argument("--depths", type=int, default=3, help="chained draft depths to measure")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-tokens", type=int, default=65_536)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        model, _ = load_model(args.checkpoint)
        tok = load_tokenizer(args.checkpoint)
    except (CheckpointError, OSError, ValueError) as e:
        p.error(f"cannot load {args.checkpoint}: {e}")
    if model.cfg.num_mtp_modules == 0:
        p.error(f"{args.checkpoint} has no MTP module (num_nextn_predict_layers = 0): nothing to measure")
    result = evaluate(model, heldout_windows(tok, args.seq_len, args.eval_tokens), args.depths)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

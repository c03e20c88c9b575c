"""Train the shipped tiny GLM-4.5-layout MTP model on the Python standard library's own source.

    python -m models.training.train --output models/tiny [--steps N] [--minutes M] [--seed S]

What it does, start to finish (every step seeded, so the same command gives the same model):
  1. corpus: the stdlib's .py files (no tests, no site-packages, no huge generated files), sorted and
     split BY FILE: every 20th file is held out, so held-out numbers measure code the model never saw;
  2. tokenizer: byte-level BPE trained on the train split only (models/training/tokenizer.py);
  3. model: a few-million-parameter config of this family (GQA, partial RoPE, dense layer 0 then MoE
     layers with grouped sigmoid routing and a shared expert, one MTP module);
  4. loss: the DeepSeek-V3 MTP objective CE(main) + lambda * CE(MTP depth 1); routing is kept balanced
     with DeepSeek-V3's aux-loss-free bias update of `e_score_correction_bias`;
  5. evaluation on the held-out files: main loss, MTP loss and MTP greedy acceptance (the fraction of
     positions where the MTP draft equals the main model's greedy token, i.e. what greedy speculative
     decoding accepts at depth 1);
  6. output: a Hugging Face Glm4Moe checkpoint (MTP at model.layers.{L}.*) + tokenizer files +
     training_report.json, written to a temp dir and renamed into place only when complete.

`--minutes` is a wall-clock budget: after timing the first steps it may lower the step count so the run
fits; the step count actually used is recorded in the report (re-run with `--steps N` to reproduce).

This module owns the model config, initialisation, router balancing, training loop, checkpoint writing and
CLI; steps 1-2 (corpus, tokenizer) are models/training/data.py's, the losses and step 5 models/training/eval.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import save_file

from models.checkpoint_export import to_hf_config, to_hf_tensors
from models.config import ModelConfig
from models.feed_forward import Router
from models.glm4_moe import Glm4MoeMTPModel
from models.training.chained import chained_losses
from models.training.configs import PRESETS, TrainSettings
from models.training.data import prepare_corpus
from models.training.eval import eval_windows, evaluate
from models.training.tokenizer import EOS_TOKEN, save_tokenizer

# ------------------------------------------------------------------------------------------------ model


def init_weights(model: Glm4MoeMTPModel, seed: int, std: float = 0.02) -> None:
    """GPT-style init: N(0, 0.02) matrices, output projections scaled by depth, unit norms, zero router bias.

    (The module constructors leave experts and the router at zero, which would never break symmetry.)
    """
    g = torch.Generator().manual_seed(seed)
    num_blocks = model.cfg.num_hidden_layers + model.cfg.num_mtp_modules
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                scale = (
                    std / math.sqrt(2 * num_blocks)
                    if name.endswith(("o_proj.weight", "down_proj.weight", "w_down"))
                    else std
                )
                p.copy_(scale * torch.randn(p.shape, generator=g))


def count_params(model: Glm4MoeMTPModel) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    return {"total": total, "main": total - mtp, "mtp_module": mtp}


class RouterBalancer:
    """DeepSeek-V3 aux-loss-free load balancing: after each step, nudge every router's
    e_score_correction_bias up for under-loaded experts and down for over-loaded ones (by gamma).

    The bias only affects WHICH experts are chosen, not their weights, so no gradient is involved.
    """

    def __init__(self, model: Glm4MoeMTPModel, gamma: float) -> None:
        self.gamma = gamma
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._make_hook(i))
        self.enabled = True

    def _make_hook(self, i: int):
        def hook(module, inputs, output):
            if self.enabled:
                self.loads[i] += torch.bincount(output[0].flatten(), minlength=module.num_experts).float()

        return hook

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias update; returns the worst max/mean load ratio seen this step (1.0 = balanced)."""
        worst = 1.0
        for r, load in zip(self.routers, self.loads, strict=True):
            if load.sum() > 0:
                r.e_score_correction_bias.add_(self.gamma * torch.sign(load.mean() - load))
                worst = max(worst, float(load.max() / load.mean()))
            load.zero_()
        return worst


# --------------------------------------------------------------------------------------------- training


def lr_at(step: int, s: TrainSettings, total_steps: int, decay_start: int | None = None) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr ("cosine"), or constant until `decay_start` and
    linear decay to min_lr_ratio * lr at `total_steps` ("wsd": warm-up, stable, decay)."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.schedule == "wsd":
        start = wsd_decay_start(s, total_steps) if decay_start is None else decay_start
        progress = min(1.0, max(0, step - start) / max(1, total_steps - start))
        return s.lr * (1 - (1 - s.min_lr_ratio) * progress)
    progress = min(1.0, (step - s.warmup_steps) / max(1, total_steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def wsd_decay_start(s: TrainSettings, total_steps: int) -> int:
    return max(s.warmup_steps, round(total_steps * (1 - s.decay_fraction)))


def make_optimizer(model: Glm4MoeMTPModel, s: TrainSettings) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms), router bias excluded (it is not trained by gradients)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8)


def sample_batch(stream: torch.Tensor, s: TrainSettings, g: torch.Generator) -> torch.Tensor:
    """B random windows of seq_len+1 tokens from the train stream (seeded generator: reproducible)."""
    starts = torch.randint(0, len(stream) - s.seq_len - 1, (s.batch_size,), generator=g)
    return torch.stack([stream[i : i + s.seq_len + 1] for i in starts.tolist()])


def make_progress() -> Progress:
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )


def train(model, stream, s: TrainSettings, seed: int, minutes: float | None, decay_start: int | None = None) -> dict:
    """The training loop; returns what the report needs (steps run, tokens seen, last losses).

    Budget (--minutes, ~15% kept for tokenizer / evaluation / saving): the cosine schedule fixes the step count
    after 20 steps. The WSD schedule instead runs at constant LR until 80% of the budget is spent, then decays
    over a quarter as many steps again; its LR before the decay does not depend on the step count, so a shared
    machine's changing load costs steps but never reproducibility (`--steps N --decay-start D` re-runs it).
    """
    opt = make_optimizer(model, s)
    balancer = RouterBalancer(model, s.bias_update_speed)
    g = torch.Generator().manual_seed(seed + 1)
    total_steps = s.steps
    budget = None if minutes is None else minutes * 60 * 0.85
    adapt = budget is not None and (s.schedule == "cosine" or decay_start is None)
    if s.schedule == "wsd" and decay_start is None:
        decay_start = wsd_decay_start(s, total_steps)
    t0 = time.perf_counter()
    ema: list[float] = []  # smoothed [main, mtp depth 1, ...] train losses for the progress bar
    model.train()
    with make_progress() as progress:
        task = progress.add_task("train", total=total_steps, info="")
        step = 0
        while step < total_steps:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, s, total_steps, decay_start)
            main_ce, ces, _, _ = chained_losses(model, sample_batch(stream, s, g), s.mtp_depths)
            loss = main_ce + sum(lam * ce for lam, ce in zip(s.mtp_lambdas, ces, strict=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            opt.step()
            imbalance = balancer.update()
            cur = [main_ce.item()] + [ce.item() for ce in ces]
            ema = cur if not ema else [0.95 * e + 0.05 * c for e, c in zip(ema, cur, strict=True)]
            step += 1
            elapsed = time.perf_counter() - t0
            if (
                adapt and budget and s.schedule == "wsd" and decay_start is not None
                and s.warmup_steps <= step < decay_start and elapsed >= (1 - s.decay_fraction) * budget
            ):  # fmt: skip
                decay_start, total_steps = step, min(total_steps, round(step / (1 - s.decay_fraction)))
                progress.update(task, total=total_steps)
                progress.console.log(f"--minutes {minutes}: decaying from step {step} to {total_steps}")
            if adapt and budget and s.schedule == "cosine" and step == 20:
                # Fit the run into the budget, keeping ~15% for tokenizer/eval/save; the LR schedule follows.
                per_step = (time.perf_counter() - t0) / step
                fit = int(budget / per_step)
                if fit < total_steps:
                    total_steps = max(step + 1, fit)
                    progress.update(task, total=total_steps)
                    progress.console.log(f"--minutes {minutes}: {per_step:.2f} s/step, running {total_steps} steps")
            progress.update(
                task,
                advance=1,
                info=f"main {ema[0]:.3f}  mtp {_fmt(ema[1:])}  lr {lr_at(step, s, total_steps, decay_start):.1e}",
            )
            if step % 50 == 0:
                progress.console.log(
                    f"step {step}: main {ema[0]:.3f} mtp {_fmt(ema[1:])} max/mean expert load {imbalance:.2f} "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
    balancer.enabled = False
    return {
        "steps": total_steps,
        "decay_start": decay_start,
        "tokens_seen": total_steps * s.batch_size * s.seq_len,
        "train_seconds": time.perf_counter() - t0,
        "final_train_main_loss_ema": ema[0] if ema else None,
        "final_train_mtp_loss_ema": ema[1] if ema else None,
        "final_train_mtp_loss_ema_per_depth": ema[1:],
    }


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.3f}" for x in xs)


# ----------------------------------------------------------------------------------------------- output


SHIP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def round_to_ship_dtype(model: Glm4MoeMTPModel, ship_dtype: str) -> None:
    """Round every matrix to the dtype it will be stored in (1-D tensors: norms, router bias stay fp32), so the
    final evaluation measures exactly the shipped weights. A no-op for float32."""
    dtype = SHIP_DTYPES[ship_dtype]
    for p in model.parameters():
        if p.dim() >= 2:
            p.copy_(p.to(dtype).float())


def save_checkpoint(model: Glm4MoeMTPModel, cfg: ModelConfig, path: Path, ship_dtype: str) -> None:
    """config.json + model.safetensors in the HF Glm4Moe layout; matrices in `ship_dtype`, 1-D tensors fp32.

    fp32 norms / router biases cost nothing in size and keep routing decisions exactly as evaluated; every
    loader (models/checkpoint.py, transformers with dtype=float32) upcasts the bf16 matrices exactly.
    """
    path.mkdir(parents=True, exist_ok=True)
    dtype = SHIP_DTYPES[ship_dtype]
    tensors = {k: (t.to(dtype) if t.dim() >= 2 else t) for k, t in to_hf_tensors(model).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {**to_hf_config(cfg), "dtype": ship_dtype}
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def write_checkpoint(model, tok, cfg: ModelConfig, report: dict, output: Path, ship_dtype: str) -> None:
    """Write everything to a temp dir beside `output`, then swap it in (a half-written dir never looks valid)."""
    output = output.resolve()
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_checkpoint(model, cfg, tmp, ship_dtype)
    save_tokenizer(tok, tmp, model_max_length=cfg.max_position_embeddings)
    eos = cfg.eos_token_id[0]
    gen = {"eos_token_id": eos, "pad_token_id": eos, "do_sample": False, "max_new_tokens": 128}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in tmp.iterdir())
    (tmp / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    if output.exists():
        output.rename(old)
    tmp.rename(output)
    if old.exists():
        shutil.rmtree(old)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="which shipped model to train")
    p.add_argument("--output", type=Path, required=True, help="checkpoint directory to (re)create")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget; may lower --steps to fit")
    p.add_argument("--decay-start", type=int, default=None, help="WSD schedule: first step of the LR decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the preset's)")
    p.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens scored at the end")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "threads", "eval_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    preset = PRESETS[args.model]
    overrides = {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "lr", "threads", "eval_tokens")}
    s = replace(preset.settings, **{k: v for k, v in overrides.items() if v is not None})
    torch.set_num_threads(s.threads)
    torch.manual_seed(args.seed)

    corpus = prepare_corpus(s.vocab_size)
    tok = corpus.tok
    cfg = preset.model_config(tok.get_vocab_size(), corpus.eos_id)
    model = Glm4MoeMTPModel(cfg)
    init_weights(model, args.seed)
    params = count_params(model)
    print(f"model {preset.name}: {params['total']:,} parameters ({params['mtp_module']:,} in the MTP module)")

    windows = eval_windows(corpus.heldout_stream, s.seq_len, s.eval_tokens)
    before = evaluate(model, windows[:8], s.eval_depths)
    run = train(model, corpus.train_stream, s, args.seed, args.minutes, args.decay_start)
    round_to_ship_dtype(model, s.ship_dtype)
    heldout = evaluate(model, windows, s.eval_depths)
    print(
        f"held-out: main loss {heldout['main_loss']:.3f}, MTP loss per depth {_fmt(heldout['mtp_loss_per_depth'])}, "
        f"acceptance unconditional {_fmt(heldout['acceptance_unconditional'])}, "
        f"conditional {_fmt(heldout['acceptance_conditional'])}"
    )
    terms = " + ".join(f"{lam} * CE(MTP depth {j})" for j, lam in enumerate(s.mtp_lambdas, start=1))
    report = {
        "command": "python -m models.training.train " + " ".join(sys.argv[1:] if argv is None else argv),
        "reproduce": f"python -m models.training.train --model {preset.name} --output {args.output} "
        f"--steps {run['steps']} --seed {args.seed}"
        + (f" --decay-start {run['decay_start']}" if s.schedule == "wsd" else ""),
        "model": preset.name,
        "seed": args.seed,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus": corpus.report(),
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": tok.get_vocab_size(),
            "eos_token": EOS_TOKEN,
        },
        "params": params,
        "settings": {k: getattr(s, k) for k in TrainSettings.__dataclass_fields__},
        "loss": f"CE(main) + {terms}",
        "training": run,
        "heldout_untrained_sample": before,
        "heldout": heldout,
        "threads": s.threads,
        "wall_seconds": None,
        "model_config": cfg.to_dict(),
    }
    report["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    write_checkpoint(model, tok, cfg, report, args.output, s.ship_dtype)
    print(f"wrote {args.output} in {report['wall_seconds']:.0f} s total")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

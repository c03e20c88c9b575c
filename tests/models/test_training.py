"""Training-loop pieces that decide reproducibility and what is shipped: LR schedules, bf16 shipping, CLI checks."""

from __future__ import annotations

import json

import pytest
import torch

from models.checkpoint import load_model
from models.testing import random_model, tiny_config
from models.training.configs import PRESETS, TrainSettings
from models.training.train import lr_at, parse_args, round_to_ship_dtype, save_checkpoint


def test_wsd_lr_before_the_decay_does_not_depend_on_the_step_count():
    """What lets a --minutes run be reproduced with --steps N --decay-start D."""
    s = TrainSettings(lr=1e-3, warmup_steps=10, schedule="wsd", min_lr_ratio=0.1)
    for step in range(0, 300, 7):
        assert lr_at(step, s, 400, decay_start=300) == lr_at(step, s, 1000, decay_start=300)
    assert lr_at(299, s, 400, 300) == pytest.approx(1e-3)
    assert lr_at(350, s, 400, 300) == pytest.approx(1e-3 * (1 - 0.9 * 0.5))
    assert lr_at(400, s, 400, 300) == pytest.approx(1e-4)
    assert lr_at(640, PRESETS["deep"].settings, 800) == pytest.approx(2e-3)  # default decay start = 80 %


def test_cosine_schedule_of_the_tiny_recipe_is_unchanged():
    s = PRESETS["tiny"].settings
    assert s.schedule == "cosine" and s.mtp_lambdas == (0.3,) and s.steps == 900
    assert lr_at(59, s, 900) == pytest.approx(2.5e-3)
    assert lr_at(899, s, 900) == pytest.approx(2.5e-4, rel=1e-3)


def test_bf16_shipping_round_trips_exactly(tmp_path):
    cfg = tiny_config()
    model = random_model(cfg, seed=1)
    round_to_ship_dtype(model, "bfloat16")
    save_checkpoint(model, cfg, tmp_path, "bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, _ = load_model(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert b.dtype == torch.float32 and torch.equal(a, b), name


@pytest.mark.parametrize("flag", ["--steps", "--threads", "--eval-tokens"])
def test_non_positive_counts_are_a_one_line_error(flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--output", "x", flag, "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag} must be >= 1, got 0" in err

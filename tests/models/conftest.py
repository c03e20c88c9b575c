"""Fixtures of the MLA model tests (tests/models/test_mla_parity.py, test_mla_config.py)."""

from __future__ import annotations

import pytest

from models.testing import MLA_VARIANTS, make_mla_checkpoint


@pytest.fixture(scope="session")
def mla_checkpoints(tmp_path_factory):
    """variant -> checkpoint directory (each written once per session, by transformers' save_pretrained)."""
    made: dict[str, object] = {}

    def get(variant: str):
        if variant not in made:
            model_type, overrides = MLA_VARIANTS[variant]
            made[variant] = tmp_path_factory.mktemp(variant)
            make_mla_checkpoint(made[variant], model_type, seed=1, **overrides)
        return made[variant]

    return get

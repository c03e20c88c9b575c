"""The lockstep settings fingerprint (pure): what ranks compare at start-up, and the one-line difference."""

from runtime.multirank.fingerprint import first_difference, settings_fingerprint
from tests.runtime.engine_utils import make_engine


def fingerprint(engine, extra=None):
    return settings_fingerprint(engine.executor, engine.model_cfg, engine.cfg, extra)


def test_same_settings_agree_and_a_different_k_is_named():
    a, b = fingerprint(make_engine(2)), fingerprint(make_engine(2))
    assert first_difference([a, b, a]) is None
    c = fingerprint(make_engine(1, max_num_tokens=64))
    assert first_difference([a, a, c]) == ("ranks disagree on runtime.num_draft_tokens: rank 0 has 2, rank 2 has 1; "
                                           "launch every rank with the same engine and flags")  # fmt: skip


def test_fingerprint_covers_model_runtime_and_executor():
    fp = fingerprint(make_engine(2))
    assert fp["executor"] == "TorchExecutor"
    assert {"model.num_hidden_layers", "model.vocab_size", "runtime.max_batch", "runtime.block_size"} <= set(fp)
    assert first_difference([fp, {**fp, "model.num_hidden_layers": 99}]).startswith(
        "ranks disagree on model.num_hidden_layers: rank 0 has ")
    missing = {k: v for k, v in fp.items() if k != "executor"}
    assert "rank 1 has '<missing>'" in first_difference([fp, missing])


def test_the_launch_mapping_is_part_of_the_fingerprint():
    """A rank launched with another --collective-timeout or mapping is named at start-up, not in a hang."""
    engine = make_engine(2)
    a = fingerprint(engine, {"parallel.tp_size": 2, "watchdog.collective_timeout": 60.0})
    b = fingerprint(engine, {"parallel.tp_size": 2, "watchdog.collective_timeout": 5.0})
    assert first_difference([a, b]) == ("ranks disagree on watchdog.collective_timeout: rank 0 has 60.0, rank 1 "
                                        "has 5.0; launch every rank with the same engine and flags")  # fmt: skip

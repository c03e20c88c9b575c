"""mtp-build's derived defaults: `--ep-size` follows `--tp-size` (the only valid values with tp > 1 are tp-size and
world-size), and the build says which it chose."""

from __future__ import annotations

from models.engine_format import Parallel, load_engine_config


def test_ep_size_defaults_to_tp_size_and_says_so(tp2_build):
    """tp2_build (tests/builder/conftest.py) is `mtp-build --world-size 2 --tp-size 2` with no --ep-size, shared
    with test_tp_build.py: its printed output and the engine it wrote are what this test checks."""
    out, printed = tp2_build
    assert "--ep-size not given: using --ep-size 2 (= --tp-size" in " ".join(printed.split())
    assert load_engine_config(out).parallel == Parallel(world_size=2, ep_size=2, tp_size=2)

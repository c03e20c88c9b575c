"""mtp-build's derived defaults: `--ep-size` follows `--tp-size` (the only valid values with tp > 1 are tp-size and
world-size), and the build says which it chose."""

from __future__ import annotations

import pytest

from models.engine_format import Parallel, load_engine_config

# its fixture may pay the session's compiled TP2 build (tests/conftest.py tiny_tp2_build: minutes on a loaded machine)
pytestmark = pytest.mark.timeout(2400)


def test_ep_size_defaults_to_tp_size_and_says_so(tiny_tp2_build):
    """tiny_tp2_build (tests/conftest.py) is `mtp-build --world-size 2 --tp-size 2` with no --ep-size, shared with
    test_tp_build.py and tests/runtime/test_mpi_tp.py: its printed output and the engine it wrote are checked here."""
    out, printed = tiny_tp2_build
    assert "--ep-size not given: using --ep-size 2 (= --tp-size" in " ".join(printed.split())
    assert load_engine_config(out).parallel == Parallel(world_size=2, ep_size=2, tp_size=2)

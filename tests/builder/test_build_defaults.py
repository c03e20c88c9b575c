"""mtp-build's derived defaults: `--ep-size` follows `--tp-size` (the only valid values with tp > 1 are tp-size and
world-size), and the build says which it chose."""

from __future__ import annotations

from builder import cli
from models.engine_format import Parallel, load_engine_config
from tests.builder.conftest import LIMITS


def test_ep_size_defaults_to_tp_size_and_says_so(checkpoint, tmp_path, capsys):
    out = tmp_path / "engine"
    argv = ["--checkpoint", str(checkpoint), "--output", str(out), "--world-size", "2", "--tp-size", "2"]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    rc = cli.main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "--ep-size not given: using --ep-size 2 (= --tp-size" in " ".join(captured.out.split())
    assert load_engine_config(out).parallel == Parallel(world_size=2, ep_size=2, tp_size=2)

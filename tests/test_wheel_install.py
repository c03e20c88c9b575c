"""`pip install` gives a package that starts: a wheel built from a fresh clone ships the C++ kernels and runs.

The wheel is built the documented way (`pip wheel --no-deps --no-build-isolation`: scikit-build-core runs
CMakeLists.txt against the installed torch) from a `git clone` of this repository, so only committed files count,
then installed into a new virtual environment outside the repository, where `mtp-build` and `mtp-run` run with the
working directory outside it too.

Why the new environment borrows this one's site-packages: installing the dependencies (torch, ONNX Runtime, ...)
into it from the index would take many minutes. A `.pth` file in its site-packages names this environment's
site-packages directory instead. A plain directory line in a `.pth` only extends sys.path: it does not process the
`.pth` files of that directory, so the editable install of this repository registered there (its import finder)
never runs, and the repository is not importable in the new environment; the test asserts that plugins.cpp_ops,
its library and runtime come from the new environment. The wheel goes in with `--no-deps --no-index`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_checked

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_wheel_from_a_fresh_clone_installs_and_runs(wheel_venv, tmp_path: Path) -> None:
    """wheel_venv (tests/conftest.py): the wheel of a fresh clone installed into a new virtual environment."""
    venv, site, env = wheel_venv
    py = venv / "bin" / "python"
    outside = tmp_path / "cwd"
    outside.mkdir()
    where = run_checked([str(py), "-c", "import plugins.cpp_ops, runtime; print(plugins.cpp_ops.LIBRARY, runtime.__file__)"],
                        cwd=outside, env=env, timeout=120).stdout.split()  # fmt: skip
    library, runtime_init = (Path(p) for p in where)
    assert library.is_relative_to(site) and runtime_init.is_relative_to(site), (where, site)
    assert library.is_file()

    engine = tmp_path / "engine"
    run_checked([str(venv / "bin" / "mtp-build"), "--checkpoint", str(ROOT / "models" / "tiny"), "--output", str(engine),
                 "--compile", "none"], cwd=outside, env=env, timeout=600)  # fmt: skip
    run = run_checked([str(venv / "bin" / "mtp-run"), "--engine", str(engine), "--prompt", "def main(", "--max-tokens",
                       "8", "--json"], cwd=outside, env=env, timeout=300)  # fmt: skip
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert records and "summary" in records[-1], run.stdout
    (rec,) = records[:-1]
    assert "error" not in rec, rec
    assert len(rec["output_ids"]) > 0, rec

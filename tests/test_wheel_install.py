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
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def test_wheel_from_a_fresh_clone_installs_and_runs(tmp_path: Path) -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout (or git is missing): the wheel is built from a fresh clone of it")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    src = tmp_path / "clone"
    _run([git, "clone", "--quiet", str(ROOT), str(src)], cwd=tmp_path, env=env, timeout=120)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(src)],
         cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    (wheel,) = wheels.glob("mtp_engine-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env, timeout=120)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path, env=env, timeout=60).stdout.strip())  # fmt: skip
    (site / "_mtp_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # this env's packages
    _run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path, env=env,
         timeout=300)  # fmt: skip

    outside = tmp_path / "cwd"
    outside.mkdir()
    where = _run([str(py), "-c", "import plugins.cpp_ops, runtime; print(plugins.cpp_ops.LIBRARY, runtime.__file__)"],
                 cwd=outside, env=env, timeout=120).stdout.split()  # fmt: skip
    library, runtime_init = (Path(p) for p in where)
    assert library.is_relative_to(site) and runtime_init.is_relative_to(site), (where, site)
    assert library.is_file()

    engine = tmp_path / "engine"
    _run([str(venv / "bin" / "mtp-build"), "--checkpoint", str(ROOT / "models" / "tiny"), "--output", str(engine),
          "--compile", "none"], cwd=outside, env=env, timeout=600)  # fmt: skip
    run = _run([str(venv / "bin" / "mtp-run"), "--engine", str(engine), "--prompt", "def main(", "--max-tokens", "8",
                "--json"], cwd=outside, env=env, timeout=300)  # fmt: skip
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert records and "summary" in records[-1], run.stdout
    (rec,) = records[:-1]
    assert "error" not in rec, rec
    assert len(rec["output_ids"]) > 0, rec

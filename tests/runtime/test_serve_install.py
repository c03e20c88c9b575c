"""The installed package serves outside a checkout: build the wheel, install it into a bare directory, run
mtp-serve from elsewhere with only that directory on the path, and check that the stub imported it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from runtime.serving.triton_server import free_ports
from tests.runtime import serve_helpers as h

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_installed_wheel_serves_outside_the_checkout(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(h.ROOT)],
                   check=True, cwd=tmp_path, capture_output=True)  # fmt: skip
    wheel = next((tmp_path / "dist").glob("mtp_engine-*.whl"))
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    serve = h.MtpServe(outside / "repo", free_ports(3), checkpoint=site / "models" / "tiny", pythonpath=site)
    try:
        serve.wait_ready()
        responses, error = h.generate(serve.ports[1], "def main(", 4)
        assert error is None and len(h.ids_of(responses)) == 4, error
        log = (outside / "repo.tritonserver.log").read_text()
        assert f"runtime={site / 'runtime'}" in log, "the stub did not import the installed package"
        assert str(h.ROOT) not in (outside / "repo" / "mtp" / "config.pbtxt").read_text()
        serve.signal(signal.SIGTERM)
        assert serve.wait(60) == 0, serve.output()
    finally:
        serve.kill_all()

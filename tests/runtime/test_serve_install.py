"""The installed package serves outside a checkout: the wheel of a fresh clone, installed into a new virtual
environment (the `wheel_venv` fixture, tests/conftest.py), runs mtp-serve from elsewhere with that environment's
Python, and the Triton stub imports the installed package, not this repository."""

from __future__ import annotations

import signal

import pytest

from runtime.serving.triton_server import free_ports
from tests.runtime import serve_helpers as h

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def test_installed_wheel_serves_outside_the_checkout(wheel_venv, tmp_path):
    venv, site, _ = wheel_venv
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    serve = h.MtpServe(outside / "repo", free_ports(3), checkpoint=site / "models" / "tiny", pythonpath=None,
                       python=venv / "bin" / "python")  # fmt: skip
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

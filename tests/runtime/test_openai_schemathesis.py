"""schemathesis fuzzes a real `mtp-serve --frontend openai` (models/tiny, torch, K=3) from its own /openapi.json:
no 5xx, every response (JSON and SSE events) conforms to the document, schema-violating requests are refused.
Bounded (deterministic generation, a few examples per operation); docs/SERVING.md has the full run's command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.runtime.openai_helpers import OpenAIServer

pytestmark = pytest.mark.timeout(900)
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance," \
         "negative_data_rejection"  # fmt: skip


def test_schemathesis_finds_no_5xx_and_no_schema_violation(tmp_path):
    srv = OpenAIServer("--num-draft-tokens", "3")
    try:
        cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
               "run", srv.url + "/openapi.json", "--checks", CHECKS, "--max-examples", "10",
               "--generation-deterministic", "--request-timeout", "120", "--no-color"]  # fmt: skip
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=800)
    finally:
        srv.stop()
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "5/5" in out.stdout and "No issues found" in out.stdout, out.stdout[-3000:]


def test_the_check_can_fail_on_a_5xx(tmp_path):
    """The same command against an app that answers 500 fails: the test above can fail."""
    app = tmp_path / "bad_app.py"
    app.write_text("from fastapi import FastAPI\nfrom fastapi.responses import JSONResponse\napp = FastAPI()\n"
                   "@app.get('/v1/models')\nasync def models():\n    return JSONResponse({}, status_code=500)\n")
    from runtime.serving.process import free_ports

    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "bad_app:app", "--port", str(port), "--log-level",
                               "warning"], cwd=tmp_path)  # fmt: skip
    try:
        cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
               "run", f"http://127.0.0.1:{port}/openapi.json", "--checks", "not_a_server_error", "--max-examples",
               "3", "--wait-for-schema", "60", "--no-color"]  # fmt: skip
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        server.terminate()
        server.wait(30)
    assert out.returncode != 0 and "Server error" in out.stdout, out.stdout[-3000:]

"""A broken tokenizer_config.json or chat template is refused by `mtp-build` and `mtp-build --check` with one line
(mtp-serve --frontend openai loads both at start-up: it used to crash there with a 26-line traceback), and so is a
tokenizer.json that does not load, by `--check`, `mtp-run` and both `mtp-serve` frontends."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from builder import cli
from models.engine_format.directory import sha256_file
from tests.builder.conftest import LIMITS
from tests.builder.engine_edits import copy_engine, reseal_manifest

BROKEN = {
    "not-json": ('{"chat_template": "{{ x }}",', "tokenizer_config.json is not valid JSON"),
    "not-an-object": ("[1, 2]", "tokenizer_config.json is not a JSON object"),
    "bad-template": (json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}"}),
                     "chat_template does not compile .*TemplateSyntaxError"),
}  # fmt: skip


def _one_line(capsys, pattern: str) -> None:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_build_refuses_a_broken_tokenizer_config(checkpoint, tmp_path, capsys, case):
    content, pattern = BROKEN[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "tokenizer_config.json").write_text(content)
    out = tmp_path / "out"
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none"]
    for k, v in LIMITS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert cli.main(argv) == 2
    _one_line(capsys, "build failed: .*" + pattern)
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_check_refuses_a_broken_tokenizer_config(engine, tmp_path, capsys, case):
    """An engine whose tokenizer_config.json is broken but sealed in its manifest (as one built before this check)."""
    content, pattern = BROKEN[case]
    copy = copy_engine(engine, tmp_path)
    (copy / "tokenizer_config.json").write_text(content)
    reseal_manifest(copy, **{"tokenizer_config.json": sha256_file(copy / "tokenizer_config.json")})
    assert cli.main(["--check", str(copy)]) == 2
    _one_line(capsys, "check failed: .*" + pattern)


def test_a_good_chat_template_passes(engine, tmp_path, capsys):
    copy = copy_engine(engine, tmp_path)
    (copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    reseal_manifest(copy, **{"tokenizer_config.json": sha256_file(copy / "tokenizer_config.json")})
    assert cli.main(["--check", str(copy)]) == 0


def test_a_tokenizer_json_that_does_not_load_is_one_line_everywhere(engine, tmp_path, capsys):
    """Sealed in the manifest, `--check` passed it, and `mtp-serve --frontend openai` crashed with a 22-line traceback
    (mtp-run: a line ending "rerun with --debug", exit 1). Now one line naming the file and the fix, exit 2, from
    `--check`, mtp-run, the OpenAI frontend and the Triton frontend's model-repository step."""
    from runtime import cli as run_cli
    from runtime.serving.process import free_ports
    from runtime.serving.triton_server import main as serve_main

    copy = copy_engine(engine, tmp_path)
    (copy / "tokenizer.json").write_text('{"model": {"type": "WordLevel", "vocab": [1, 2]')
    reseal_manifest(copy, **{"tokenizer.json": sha256_file(copy / "tokenizer.json")})
    why = re.escape(str(copy / "tokenizer.json")) + r" does not load \(.+\); copy tokenizer.json again from"
    assert cli.main(["--check", str(copy)]) == 2
    _one_line(capsys, "check failed: " + why)
    assert run_cli.main(["--engine", str(copy), "--prompt", "w1", "--max-tokens", "2"]) == 2
    _one_line(capsys, "mtp-run: error: " + why)
    assert serve_main(["--frontend", "openai", "--engine", str(copy), "--port", str(free_ports(1)[0])]) == 2
    _one_line(capsys, "mtp-serve: error: " + why)
    assert serve_main(["--model-repo", str(tmp_path / "repo"), "--engine", str(copy), "--generate-only"]) == 2
    _one_line(capsys, "mtp-serve: error: " + why)

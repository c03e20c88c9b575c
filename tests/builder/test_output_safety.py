"""`mtp-build --output` never deletes what it did not write, and a bad output path is one line, not a traceback."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest

from builder import cli, pipeline
from builder.options import BuildError
from builder.pipeline import check_output
from tests.builder.conftest import tiny_opts
from tests.builder.test_bad_checkpoint import _argv, refused


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:
    path = tmp_path / "models" / "ckpt"
    shutil.copytree(checkpoint, path)
    return path


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize(
    "where, pattern",
    [
        (lambda c: c, r"--output .* is the checkpoint directory"),
        (lambda c: c / "engine", r"--output .* is inside the checkpoint directory"),
        (lambda c: c.parent, r"--output .* contains the checkpoint directory"),
    ],
    ids=["equal", "inside", "contains"],
)
def test_output_overlapping_the_checkpoint_is_refused(ckpt, capsys, where, pattern, force):
    before = _snapshot(ckpt.parent)
    out = where(ckpt)
    rc = cli.main(_argv(ckpt, out, *(["--force"] if force else [])))
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(pattern, err), err
    assert _snapshot(ckpt.parent) == before, "the checkpoint (and its parent) must be untouched"


def test_output_symlinked_to_the_checkpoint_is_refused(ckpt, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    before = _snapshot(ckpt)
    assert cli.main(_argv(ckpt, link, "--force")) == 2
    assert "is the checkpoint directory" in capsys.readouterr().err
    assert _snapshot(ckpt) == before


def test_force_never_deletes_a_directory_mtp_build_did_not_write(checkpoint, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    (out / "config.json").write_text('{"model_type": "glm4_moe"}')  # a checkpoint-like config is no engine marker
    assert cli.main(_argv(checkpoint, out, "--force")) == 2
    err = capsys.readouterr().err
    assert "was not written by mtp-build" in err and "even with --force" in err, err
    assert (out / "notes.txt").read_text() == "precious"


def test_engine_dir_with_foreign_files_is_not_replaced(checkpoint, engine, tmp_path, capsys):
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    (copy / "rank0" / "my_notes.txt").write_text("mine")
    for force in ([], ["--force"]):
        assert cli.main(_argv(checkpoint, copy, *force)) == 2
        err = capsys.readouterr().err
        assert "files mtp-build did not write: rank0/my_notes.txt" in err, err
    assert (copy / "rank0" / "my_notes.txt").read_text() == "mine"


def test_incomplete_engine_needs_force(checkpoint, engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    (copy / "rank0" / "main.onnx").unlink()
    with pytest.raises(BuildError, match="is an incomplete engine directory .*pass --force to replace it"):
        check_output(tiny_opts(checkpoint, copy))
    check_output(tiny_opts(checkpoint, copy, force=True))


@pytest.mark.parametrize("damaged", ["config.json", "manifest.json"])
def test_the_advised_force_rebuild_replaces_a_damaged_engine(checkpoint, engine, tmp_path, damaged):
    """A truncated config.json or manifest.json (a full disk): every loader says "rebuild it with `mtp-build ...
    --force`", and that command used to refuse ("was not written by mtp-build ... even with --force")."""
    from models.engine_format import EngineDirError, load_engine_config

    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    text = (copy / damaged).read_text()
    (copy / damaged).write_text(text[: len(text) // 2])
    with pytest.raises(EngineDirError) as e:
        load_engine_config(copy)
    assert "--force" in str(e.value), e.value  # the advice
    with pytest.raises(BuildError, match="pass --force to replace it"):
        check_output(tiny_opts(checkpoint, copy))
    check_output(tiny_opts(checkpoint, copy, force=True))  # what the advice says now works


def test_complete_engine_and_empty_dir_may_be_replaced(checkpoint, engine, tmp_path):
    check_output(tiny_opts(checkpoint, engine))
    (tmp_path / "empty").mkdir()
    check_output(tiny_opts(checkpoint, tmp_path / "empty"))


def test_output_is_a_file(checkpoint, tmp_path, capsys):
    out = tmp_path / "engine"
    out.write_text("x")
    assert cli.main(_argv(checkpoint, out, "--force")) == 2
    assert "exists and is a file" in capsys.readouterr().err
    assert out.read_text() == "x"


def test_output_under_a_file(checkpoint, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    refused(capsys, checkpoint, tmp_path / "afile" / "engine", r"parent .*afile is a file, not a directory")


def test_output_symlink_loop(checkpoint, tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    rc = cli.main(_argv(checkpoint, loop))
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "symbolic link loop" in err, err
    rc = cli.main(_argv(checkpoint, loop / "engine"))
    err = capsys.readouterr().err
    assert rc == 2 and "symbolic link loop" in err, err


def test_output_where_nothing_can_be_created(checkpoint, capsys):
    """sysfs refuses new directories even to root: the real error, named, in one line."""
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs here")
    rc = cli.main(_argv(checkpoint, Path("/sys/mtp_engine_test")))
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot create the build directory /sys/.mtp_engine_test.tmp-" in err, err
    assert "choose an --output on a writable filesystem" in err


def test_output_on_a_read_only_filesystem(checkpoint, tmp_path, capsys, monkeypatch):
    """No read-only mount exists here (and tests may not make one): mkdir fails the way it does on one."""
    real_mkdir = Path.mkdir

    def ro_mkdir(self, *a, **kw):
        if self.name.startswith(".engine.tmp-"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", ro_mkdir)
    rc = cli.main(_argv(checkpoint, tmp_path / "engine"))
    err = capsys.readouterr().err
    assert rc == 2 and "Read-only file system" in err and len(err.strip().splitlines()) == 1, err


def test_write_failure_during_export_is_one_line_and_cleaned(checkpoint, tmp_path, capsys, monkeypatch):
    def full_disk(rank, opts, work, geom, rep):
        (work / "rank0").mkdir()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(work / "rank0" / "main.onnx.data"))

    monkeypatch.setattr(pipeline, "_export_rank", full_disk)
    refused(capsys, checkpoint, tmp_path / "engine", r"writing the engine failed: .*No space left on device")


def test_internal_error_is_one_line_and_debug_shows_the_traceback(checkpoint, tmp_path, capsys, monkeypatch):
    def bug(rank, opts, work, geom, rep):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(pipeline, "_export_rank", bug)
    out = tmp_path / "engine"
    assert cli.main(_argv(checkpoint, out)) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "internal error: ZeroDivisionError: a bug" in err, err
    assert "--debug" in err
    with pytest.raises(ZeroDivisionError):
        cli.main(_argv(checkpoint, out, "--debug"))
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback_of_a_bad_input(tmp_path):
    with pytest.raises(BuildError, match="does not exist"):
        cli.main(_argv(tmp_path / "nope", tmp_path / "engine", "--debug"))

"""mtp-run on bad input, signals and a plain (non-mpirun) launch: one line on stderr, never a traceback,
the documented exit code, and no shared-memory file left behind (issue 8 items 7 and 8, run side)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
MTP_RUN = Path(sys.executable).parent / "mtp-run"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def run_main(capsys, *argv) -> tuple[int, str]:
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    return rc, err


def bad_files(tmp: Path) -> dict[str, Path]:
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp / "blank.txt").write_text("\n   \n")
    return {"binary": tmp / "binary.txt", "blank": tmp / "blank.txt", "dir": tmp, "missing": tmp / "nope.txt"}


CKPT = ["--checkpoint", TINY, "--prompt", "x", "--max-tokens", "2"]
BAD_FLAGS = [
    (["--temperature", "-1"], "temperature=-1.0: must be a finite number >= 0"),
    (["--temperature", "nan"], "temperature=nan"),
    (["--temperature", "inf"], "temperature=inf"),
    (["--top-p", "0"], "top_p=0.0: must be a number in (0, 1]"),
    (["--top-p", "nan"], "top_p=nan"),
    (["--top-k", "-1"], "top_k=-1: must be an int >= 0"),
    (["--max-tokens", "0"], "max_tokens=0: must be an int >= 1"),
    (["--seed", "-1"], "seed=-1: must be an int in [0, 2**64)"),
    (["--seed", str(2**64)], "seed=18446744073709551616"),
    (["--stop", ""], "stop=('',): must be a tuple of non-empty strings"),
    (["--num-blocks", "1"], "num_blocks=1: need at least 2"),
    (["--num-state-snapshots", "-1"], "num_state_snapshots=-1: must be >= 0"),
    (["--state-snapshot-interval", "24"], "state_snapshot_interval=24: must be a multiple of block_size=16"),
    (["--max-batch", "0"], "max_batch=0: must be >= 1"),
    (["--prefill-chunk", "0"], "max_prefill_chunk=0: must be >= 1"),
    (["--num-draft-tokens", "-1"], "num_draft_tokens=-1: must be >= 0"),
    (["--num-draft-tokens", "99"], "num_draft_tokens=99 must be < block_size"),
    (["--max-num-tokens", "1"], "max_num_tokens=1 < max_batch*(1+k)"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flag_is_one_line(capsys, flags, message):
    rc, err = run_main(capsys, *CKPT, *flags)
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(f"mtp-run: error: {message}"), err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prompts-file", "{missing}"], "does not exist"),
        (["--prompts-file", "{dir}"], "is not a file"),
        (["--prompts-file", "{binary}"], "is not UTF-8 text"),
        (["--prompts-file", "{blank}"], "has no prompts"),
        (["--engine", "{missing}", "--prompt", "x"], "does not exist; build one with `mtp-build`"),
        (["--engine", str(TINY), "--prompt", "x"], "is a model checkpoint, not an engine directory"),
        (["--engine", str(TINY), "--prompt", "x", "--executor", "tensorrt"], "--executor tensorrt cannot run here"),
        (["--prompt", "x"], "give --engine DIR"),
        (["--checkpoint", str(TINY), "--executor", "onnxruntime", "--prompt", "x"], "needs an engine directory"),
        (["--checkpoint", "{missing}", "--prompt", "x"], "nope.txt"),
    ],
)
def test_bad_file_or_source_is_one_line(capsys, tmp_path, argv, message):
    files = bad_files(tmp_path)
    rc, err = run_main(capsys, *[a.format(**files) for a in argv])
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("mtp-run: error: ") and message in err, err


def test_unparsable_flag_is_argparse_usage(capsys):
    rc, err = run_main(capsys, *CKPT, "--max-tokens", "ten")
    assert rc == 2 and "invalid int value: 'ten'" in err and "Traceback" not in err


def test_debug_shows_the_traceback(capsys, tmp_path):
    rc, err = run_main(capsys, "--prompts-file", tmp_path / "nope.txt", "--debug")
    assert rc == 2 and "Traceback" in err and err.splitlines()[-1].startswith("mtp-run: error: --prompts-file")


def test_rejected_request_is_reported_and_the_others_run(capsys):
    rc = cli.main([*map(str, CKPT), "--prompt", "", "--json"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 1 and out[0]["output_ids"] and out[1] == {"prompt": "", "error": "empty prompt: give at least one token"}
    assert out[2]["summary"]["num_requests"] == 2


def test_single_process_leaves_no_shared_memory_segment(tmp_path):
    """Importing mpi4py outside mpirun ran Open MPI's singleton init: a 16 MiB sm_segment file per run.
    Open MPI puts it in btl_sm_backing_directory, pointed at an empty folder here."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = dict(ENV, OMPI_MCA_btl_sm_backing_directory=str(shm))
    proc = subprocess.run([str(MTP_RUN), *map(str, CKPT), "--json"], env=env, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(shm.iterdir()) == []


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _default_sigint() -> None:
    """A child inherits an ignored SIGINT (a job started with `&` by a non-interactive shell has it ignored, and so
    has everything it starts), and Python then keeps ignoring it instead of raising KeyboardInterrupt, as nohup'd
    Unix tools should: mtp-run ran all its prompts and exited 0 in such runs. Ctrl-C from a terminal is what this
    test means, so the child gets the default disposition back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_prints_what_finished(tmp_path):
    """Ctrl-C used to print a KeyboardInterrupt traceback and lose every --json result."""
    prompts = tmp_path / "prompts.txt"
    n = 300  # about 0.5 s each (128 tokens, --max-batch 1, no prefix caching): far more than run before the signal
    prompts.write_text("".join(f"def f{i}(\n" for i in range(n)))
    proc = subprocess.Popen([str(MTP_RUN), "--checkpoint", str(TINY), "--prompts-file", str(prompts), "--max-tokens",
                             "128", "--max-batch", "1", "--no-prefix-caching", "--json"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=_default_sigint)  # fmt: skip
    try:
        # An event, not a wall-clock sleep: the process's own CPU time (load-independent) shows it has loaded and run
        # requests, about 0.5 s of CPU each, so some (not all 300) are done; a loaded machine only stretches the wait.
        deadline = time.monotonic() + 600
        while _cpu_seconds(proc.pid) < 12 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    lines = [json.loads(line) for line in out.splitlines()]
    records, summary = lines[:-1], lines[-1]["summary"]
    finished = [r for r in records if "output_ids" in r]
    assert len(records) == n and summary["num_requests"] == n
    assert 0 < len(finished) < n and all(len(r["output_ids"]) == 128 for r in finished)
    assert all(r["error"] == "interrupted (Ctrl-C) before it finished" for r in records if "error" in r)
    assert err.splitlines()[-1] == f"mtp-run: interrupted: {len(finished)} of {n} request(s) finished"


def test_prompts_file_dash_reads_standard_input(capsys, monkeypatch):
    """`--prompts-file -` reads the prompts from standard input, as Unix tools do (it used to say `- does not exist`)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("def main(\n\nimport os\n"))
    rc = cli.main(["--checkpoint", str(TINY), "--prompts-file", "-", "--max-tokens", "2", "--json"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [r["prompt"] for r in out[:-1]] == ["def main(", "import os"]
    assert out[-1]["summary"]["num_requests"] == 2
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    rc, err = run_main(capsys, "--checkpoint", TINY, "--prompts-file", "-")
    assert rc == 2 and err == "mtp-run: error: --prompts-file standard input has no prompts (one per line, blank lines skipped)\n"


@pytest.fixture(scope="module")
def k3_engine(tmp_path_factory) -> Path:
    """A K=3 engine of the tiny model (block size 16), built with mtp-build."""
    from builder import cli as build_cli

    out = tmp_path_factory.mktemp("k3") / "engine"
    argv = ["--checkpoint", str(TINY), "--output", str(out), "--compile", "none", "--max-batch", "2", "--max-num-tokens", "64",
            "--max-seq-len", "128", "--num-draft-tokens", "3"]  # fmt: skip
    assert build_cli.main(argv) == 0
    return out


def test_num_draft_tokens_above_the_engines_k_names_it(capsys, k3_engine):
    """It used to say `must be < block_size=16`, which is not why 99 is refused on a K=3 engine."""
    rc, err = run_main(capsys, "--engine", k3_engine, "--prompt", "x", "--num-draft-tokens", "99")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("mtp-run: error: num_draft_tokens=99 exceeds the 3 the engine was built for"), err

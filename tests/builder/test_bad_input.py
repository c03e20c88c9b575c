"""Every bad build input fails before anything is written, with a message naming the problem and the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from builder import cli, pipeline
from builder.options import BuildError, BuildOptions
from builder.pipeline import build, check_output
from tests.builder.conftest import LIMITS, tiny_opts


def _args(ckpt, out, **kw) -> list[str]:
    flags = {**LIMITS, **kw}
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none"]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_num_tokens=8), r"--max-num-tokens 8 is smaller than max_batch\*\(1\+K\) = 4\*\(1\+2\) = 12"),
        (dict(num_draft_tokens=4), "--num-draft-tokens 4 must be smaller than --kv-block-size 4"),
        (dict(tp_size=2), "--tp-size 2 must divide --world-size 1"),
        (dict(world_size=2, ep_size=3), "--ep-size 3 must divide --world-size 2"),
        (dict(max_seq_len=4096), "exceeds the model's max_position_embeddings=512"),
        (dict(world_size=3, ep_size=3), "n_routed_experts=4 does not split over --ep-size 3"),
    ],
    ids=["tokens-below-batch-times-steps", "k-not-below-block", "tp", "ep-world", "seq-len", "experts-split"],
)
def test_inconsistent_options_are_refused(checkpoint, tmp_path, capsys, overrides, message):
    out = tmp_path / "engine"
    with pytest.raises(BuildError, match=message):
        build(tiny_opts(checkpoint, out, **overrides))
    assert cli.main(_args(checkpoint, out, **overrides)) == 2
    assert "build failed" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_nonexistent_checkpoint(tmp_path):
    with pytest.raises(BuildError, match="checkpoint directory .*nope does not exist"):
        build(tiny_opts(tmp_path / "nope", tmp_path / "engine"))
    assert not (tmp_path / "engine").exists()


def test_unsupported_architecture(checkpoint, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    hf = json.loads((bad / "config.json").read_text())
    hf["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises(BuildError, match="unsupported model_type 'llama'"):
        build(tiny_opts(bad, tmp_path / "engine"))
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("model_type, missing", [("deepseek_v4", "hc_head"), ("glm5_next", "hc_head")])  # fmt: skip
def test_2026_families_are_refused_by_name_with_what_is_missing(tmp_path, capsys, model_type, missing):
    """The config.json transformers writes for each family (its own defaults), as mtp-build meets it: one line
    naming the family and what the engine lacks, nothing written."""
    import transformers

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    transformers.AutoConfig.for_model(model_type).save_pretrained(ckpt)
    out = tmp_path / "engine"
    assert cli.main(["--checkpoint", str(ckpt), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model_type {model_type!r} is not supported: " in err[0] and missing in err[0], err
    assert not out.exists()


def test_mimo_v2_flash_engines_refuse_tensor_parallelism_and_tensorrt_in_one_line(tmp_path, capsys):
    """MiMo-V2-Flash engines are built (tests/builder/test_mimo_v2_engine.py) on one TP rank for ONNX Runtime and its
    compiled packages; mtp-build refuses a TP build in one line and writes nothing, and --backend tensorrt (refused
    on this GPU-less machine before the model is read) is refused by the model check too."""
    from models.checkpoint import read_model_config
    from models.testing_mimo_v2 import make_mimo_v2_checkpoint

    make_mimo_v2_checkpoint(tmp_path / "ckpt", num_mtp=1)
    capsys.readouterr()  # transformers' save_pretrained progress bar
    out = tmp_path / "engine"
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--output", str(out), "--world-size", "2", "--tp-size", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp-size 2: mimo_v2_flash" in err[0] and "use --tp-size 1" in err[0], err
    assert not out.exists()
    opts = BuildOptions(checkpoint=tmp_path / "ckpt", output=out, backend="tensorrt", compile="none")
    with pytest.raises(BuildError, match=r"^mimo_v2_flash: .*TensorRT plugin \(SwaPagedAttention\) .* never been built or run .*--backend onnxruntime$"):
        opts.validate_for_model(read_model_config(tmp_path / "ckpt")[0])


def test_output_that_is_not_an_engine_is_refused_even_with_force(checkpoint, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    for force in (False, True):  # --force replaces damaged engines only, never a directory mtp-build did not write
        with pytest.raises(BuildError, match="exists and was not written by mtp-build.*even with --force"):
            build(tiny_opts(checkpoint, out, force=force))
    assert (out / "notes.txt").read_text() == "precious"


def test_existing_engine_may_be_rebuilt_in_place(checkpoint, engine):
    check_output(tiny_opts(checkpoint, engine))


def test_tensorrt_backend_without_tensorrt_stops_at_once(checkpoint, tmp_path, capsys):
    pytest.importorskip("torch")
    from builder.trt_build import tensorrt_missing

    if tensorrt_missing() is None:
        pytest.skip("TensorRT and a GPU are available here")
    with pytest.raises(BuildError, match="--backend tensorrt cannot build here: .*TensorRT"):
        build(tiny_opts(checkpoint, tmp_path / "engine", backend="tensorrt"))
    assert cli.main(_args(checkpoint, tmp_path / "engine", backend="tensorrt")) == 2
    assert "onnxruntime" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_onnxruntime_backend_refuses_half_precision(checkpoint, tmp_path):
    with pytest.raises(BuildError, match="onnxruntime supports --dtype float32 only"):
        build(tiny_opts(checkpoint, tmp_path / "engine", dtype="float16"))


def test_failed_build_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    def half_export(rank, opts, work, geom, rep):
        (work / "rank0").mkdir()
        (work / "rank0" / "main.onnx").write_bytes(b"half-written")
        raise BuildError("simulated export failure")

    monkeypatch.setattr(pipeline, "_export_rank", half_export)
    out = tmp_path / "engine"
    with pytest.raises(BuildError, match="simulated"):
        build(tiny_opts(checkpoint, out))
    assert list(tmp_path.iterdir()) == [], "a failed build must leave neither the output nor its temp directory"


def test_check_of_missing_directory(tmp_path, capsys):
    assert cli.main(["--check", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err

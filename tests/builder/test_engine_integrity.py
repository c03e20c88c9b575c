"""Engine config integrity: config.json is sealed by the manifest, its fields are cross-checked against the
graphs, and no path may leave the engine directory (each case refused by `--check` and by the executor)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from builder import cli
from models.engine_format import CONFIG_NAME, EngineConfig, EngineDirError, load_engine_config
from models.engine_format.directory import sha256_file
from runtime.executors.ort_executor import OrtExecutor
from tests.builder.engine_edits import copy_engine, edit_config, reseal_manifest


def _refused(path: Path, message: str, capsys) -> None:
    """Refused alike by load_engine_config, the ORT executor and `mtp-build --check` (one line, exit 2)."""
    for load in (load_engine_config, OrtExecutor):
        with pytest.raises(EngineDirError, match=message):
            load(path)
    assert cli.main(["--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "check failed" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "changes, message",
    [
        # Halving kv.block_size once made the ORT executor segfault (exit 139); doubling it changed the output.
        (dict(kv__block_size=2), "kv.table_width=17 but the model and limits give 34"),
        (dict(kv__block_size=8), "kv.table_width=17 but the model and limits give 9"),
        # Consistent among themselves but not with the graphs: only the plugin nodes' attributes tell.
        (
            dict(kv__block_size=8, kv__table_width=9, kv__num_blocks=37),
            "KvWrite node was built with block_size=4 but config.json gives kv.block_size=8",
        ),
        (dict(kv__num_kv_heads=1), "kv.num_kv_heads=1 but the model and limits give 2"),
        (
            dict(model__hidden_size=64, model__num_attention_heads=8),
            "declares hidden float32\\[.tokens., 32\\], the config implies float32\\[.tokens., 64\\]",
        ),
        (dict(parallel__ep_size=2), "ep_size 2 must divide world_size 1"),  # plugins/mapping.py
        (dict(kv__block_size="4"), "lacks or mistypes field .*kv.block_size='4' is not an int"),
    ],
    ids=[
        "block-size-halved",
        "block-size-doubled",
        "block-size-consistent",
        "kv-heads",
        "hidden-size",
        "ep-size",
        "mistyped",
    ],
)
def test_resealed_config_is_cross_checked_against_the_graphs(engine, tmp_path, capsys, changes, message):
    copy = copy_engine(engine, tmp_path)
    edit_config(copy, **changes)
    _refused(copy, message, capsys)


def test_unsealed_config_edit_is_refused(engine, tmp_path, capsys):
    copy = copy_engine(engine, tmp_path)
    edit_config(copy, reseal=False, num_draft_tokens=1)  # harmless-looking, still not what was built
    _refused(copy, "engine file config.json in .* is corrupted", capsys)


def _point_main_graph_at(copy: Path, rel: str) -> None:
    raw = json.loads((copy / CONFIG_NAME).read_text())
    raw["graphs"][0]["main"]["ort_optimized"] = rel
    (copy / CONFIG_NAME).write_text(json.dumps(raw))


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_graph_path_leaving_the_directory_is_refused(engine, tmp_path, capsys, where):
    copy = copy_engine(engine, tmp_path)
    outside = tmp_path / "outside.ort.onnx"  # a perfectly loadable graph, just not this engine's
    shutil.copyfile(copy / "rank0" / "main.ort.onnx", outside)
    digest = sha256_file(outside)
    rel = {"parent": "../outside.ort.onnx", "absolute": str(outside), "symlink": "rank0/link.ort.onnx"}[where]
    if where == "symlink":
        os.symlink(outside, copy / rel)
    _point_main_graph_at(copy, rel)
    reseal_manifest(copy, **{rel: digest})  # even a manifest that vouches for it does not make it inside
    message = "absolute path" if where == "absolute" else "leaves the engine directory"
    _refused(copy, message, capsys)


def test_graph_path_missing_from_the_manifest_is_refused(engine, tmp_path, capsys):
    copy = copy_engine(engine, tmp_path)
    shutil.copyfile(copy / "rank0" / "main.ort.onnx", copy / "rank0" / "other.ort.onnx")
    _point_main_graph_at(copy, "rank0/other.ort.onnx")
    reseal_manifest(copy)
    _refused(copy, "names rank0/other.ort.onnx .* has no checksum for it", capsys)


def test_checkpoint_dir_given_as_engine_gets_safe_advice(checkpoint):
    with pytest.raises(EngineDirError, match="is a model checkpoint") as e:
        load_engine_config(checkpoint)
    msg = str(e.value)
    assert "--force" not in msg and f"--output {checkpoint}" not in msg, msg  # never rebuild over the checkpoint
    assert f"mtp-build --checkpoint {checkpoint} --output engines/" in msg
    assert f"mtp-run --checkpoint {checkpoint} --executor torch" in msg


def test_config_json_round_trip(engine):
    cfg = load_engine_config(engine)
    again = EngineConfig.from_json(cfg.path, json.loads(json.dumps(cfg.to_json())))
    again.files = cfg.files
    assert again == cfg
    assert json.loads((engine / CONFIG_NAME).read_text()) == cfg.to_json()
    assert CONFIG_NAME in cfg.files  # sealed by the manifest

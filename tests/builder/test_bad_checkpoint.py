"""A damaged or unsupported checkpoint is refused by `mtp-build` with one line naming the file or field and the fix.

Every case goes through the CLI entry point (`builder.cli.main`), so an exception that escapes is a test
failure, and checks: exit code 2, exactly one line on stderr, no traceback, nothing written next to --output.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from builder import cli
from tests.builder.conftest import LIMITS, write_tokenizer

ST = "model.safetensors"


def _argv(ckpt: Path, out: Path, *extra: str, **kw) -> list[str]:
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--compile", "none", *extra]
    for k, v in {**LIMITS, **kw}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def refused(capsys, ckpt: Path, out: Path, pattern: str, *extra: str, **kw) -> str:
    """Run mtp-build; it must exit 2 with one stderr line matching `pattern` and leave nothing behind."""
    rc = cli.main(_argv(ckpt, out, *extra, **kw))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.search(pattern, lines[0]), lines[0]
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))
    return lines[0]


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint (with a real tokenizer) to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    return path


def _edit_tensors(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / ST))
    edit(tensors)
    save_file(tensors, str(ckpt / ST), metadata={"format": "pt"})


def _header_len(ckpt: Path) -> int:
    return struct.unpack("<Q", (ckpt / ST).read_bytes()[:8])[0]


Q = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.1.mlp.experts.1.gate_proj.weight"

# (id, how to damage the checkpoint directory, the message pattern)
CASES = [
    ("empty-file", lambda c: (c / ST).write_bytes(b""), r"model\.safetensors is truncated \(0 bytes\)"),
    ("truncated-length", lambda c: (c / ST).write_bytes(b"\x10\x00\x00"), r"model\.safetensors is truncated"),
    ("absurd-header-length", lambda c: (c / ST).write_bytes(struct.pack("<Q", 1 << 60) + b"{}"),
     r"model\.safetensors: header length 1152921504606846976 .*larger than the file"),
    ("header-not-json", lambda c: (c / ST).write_bytes(struct.pack("<Q", 8) + b"not json"),
     r"model\.safetensors: header is not valid JSON"),
    ("header-not-object", lambda c: (c / ST).write_bytes(struct.pack("<Q", 2) + b"[]"),
     r"model\.safetensors: header is not a JSON object"),
    ("truncated-data", lambda c: (c / ST).write_bytes((c / ST).read_bytes()[: _header_len(c) + 8 + 100]),
     r"model\.safetensors is truncated: tensor .* needs bytes up to \d+ but the file has \d+"),
    ("unknown-dtype", lambda c: _rewrite_header(c, lambda h: h[Q].update(dtype="Q9")),
     rf"model\.safetensors: tensor {re.escape(Q)} has unknown dtype 'Q9'"),
    ("offsets-mismatch-shape", lambda c: _rewrite_header(c, lambda h: h[Q].update(shape=[1, 1])),
     rf"model\.safetensors: tensor {re.escape(Q)} .*shape \[1, 1\].*but its data_offsets span"),
    ("corrupt-bytes-in-header", lambda c: _flip(c / ST, 20), r"model\.safetensors: header"),
    ("index-not-json", lambda c: (c / "model.safetensors.index.json").write_text("{oops"),
     r"model\.safetensors\.index\.json is not valid JSON"),
    ("index-no-weight-map", lambda c: (c / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
     r"model\.safetensors\.index\.json has no \"weight_map\" object"),
    ("index-shard-outside", lambda c: _index(c, "../elsewhere.safetensors"),
     r"model\.safetensors\.index\.json names shard '\.\./elsewhere\.safetensors' outside the checkpoint"),
    ("index-shard-missing", lambda c: _index(c, "model-00001-of-00002.safetensors"),
     r"shards named in model\.safetensors\.index\.json are missing"),
    ("no-weights", lambda c: (c / ST).unlink(), r"has no model\.safetensors or model\.safetensors\.index\.json"),
    ("missing-tensor", lambda c: _edit_tensors(c, lambda t: t.pop("model.norm.weight")),
     r"is missing tensors \['norm\.weight'\]; it does not match config\.json"),
    ("extra-tensor", lambda c: _edit_tensors(c, lambda t: t.update({Q.replace("weight", "bias"): torch.zeros(32)})),
     r"has tensors the config does not describe: \['layers\.0\.self_attn\.q_proj\.bias'\]"),
    ("unknown-tensor", lambda c: _edit_tensors(c, lambda t: t.update({"vision.patch.weight": torch.zeros(2)})),
     r"unexpected tensors not in the glm4_moe layout: \['vision\.patch\.weight'\]"),
    ("wrong-shape", lambda c: _edit_tensors(c, lambda t: t.update({Q: torch.zeros(5, 32)})),
     r"tensor layers\.0\.self_attn\.q_proj\.weight: expected shape \(32, 32\) from config\.json, found \(5, 32\)"),
    ("wrong-expert-shape", lambda c: _edit_tensors(c, lambda t: t.update({EXPERT: torch.zeros(3, 32)})),
     r"layers\.1\.mlp\.w_gate_up: expert 1 gate_proj has shape \(3, 32\), expert 0 has \(16, 32\)"),
    ("nan-weight", lambda c: _edit_tensors(c, lambda t: t[Q].view(-1)[:3].fill_(float("nan"))),
     rf"tensor {re.escape(Q)} in model\.safetensors has 3 NaN/Inf values"),
    ("inf-weight", lambda c: _edit_tensors(c, lambda t: t[Q].view(-1)[7:8].fill_(float("inf"))),
     rf"tensor {re.escape(Q)} in model\.safetensors has 1 NaN/Inf values"),
    ("int8-weight", lambda c: _edit_tensors(c, lambda t: t.update({Q: t[Q].to(torch.int8)})),
     rf"tensor {re.escape(Q)} in model\.safetensors has dtype int8; .*float32, float16 or bfloat16"),
    ("config-not-object", lambda c: (c / "config.json").write_text("[1, 2]"), r"config\.json: must be a JSON object"),
    ("config-not-utf8", lambda c: (c / "config.json").write_bytes(b"\xff\xfe{}"), r"config\.json is not valid JSON"),
    ("tokenizer-unparsable", lambda c: (c / "tokenizer.json").write_text('{"version": "1.0"}'),
     r"tokenizer\.json .* does not load .*remove it to build an ids-only engine"),
    ("tokenizer-too-big", lambda c: write_tokenizer(c / "tokenizer.json", 200),
     r"tokenizer\.json has 200 tokens but the model's vocab_size is 96"),
]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] = ord("}")
    path.write_bytes(bytes(data))


def _rewrite_header(ckpt: Path, edit) -> None:
    raw = (ckpt / ST).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n, "the edit must not grow the header"
    (ckpt / ST).write_bytes(raw[:8] + new + raw[8 + n :])


def _index(ckpt: Path, shard: str) -> None:
    names = list(load_file(str(ckpt / ST)))
    weight_map = {name: ST for name in names}
    weight_map[names[0]] = shard
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("damage, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_damaged_checkpoint_is_refused_in_one_line(ckpt, tmp_path, capsys, damage, pattern):
    damage(ckpt)
    refused(capsys, ckpt, tmp_path / "engine", pattern)


def _edit_config(ckpt: Path, **fields) -> None:
    hf = json.loads((ckpt / "config.json").read_text())
    hf.update(fields)
    (ckpt / "config.json").write_text(json.dumps(hf))


# (field, bad value, message pattern): negative, zero, wrong type, a list, out of range
FIELDS = [
    ("hidden_size", -32, r"hidden_size must be an integer >= 1, got -32"),
    ("vocab_size", "96", r"vocab_size must be an integer >= 1, got '96' \(a str\)"),
    ("num_attention_heads", [4], r"num_attention_heads must be an integer >= 1, got \[4\] \(a list\)"),
    ("num_hidden_layers", 2.5, r"num_hidden_layers must be an integer >= 1, got 2\.5"),
    ("num_key_value_heads", 0, r"num_key_value_heads must be an integer >= 1, got 0"),
    ("n_routed_experts", True, r"n_routed_experts must be an integer >= 0, got True \(a bool\)"),
    ("moe_intermediate_size", -16, r"moe_intermediate_size must be an integer >= 0, got -16"),
    ("num_experts_per_tok", 8, r"num_experts_per_tok=8 must be <= n_routed_experts=4"),
    ("rms_norm_eps", -1e-5, r"rms_norm_eps must be a finite number > 0, got -1e-05"),
    ("routed_scaling_factor", "big", r"routed_scaling_factor must be a finite number > 0, got 'big'"),
    ("max_position_embeddings", 0, r"max_position_embeddings must be an integer >= 1, got 0"),
    ("num_nextn_predict_layers", -1, r"num_nextn_predict_layers must be an integer >= 0, got -1"),
    ("rope_parameters", [10000], r"rope_parameters must be a JSON object, got \[10000\]"),
    ("eos_token_id", [1, 500], r"eos_token_id 500 is outside the vocabulary \(vocab_size=96\)"),
    ("tie_word_embeddings", "no", r"tie_word_embeddings must be true or false, got 'no'"),
]


@pytest.mark.parametrize("field, value, pattern", FIELDS, ids=[f"{f[0]}={f[1]!r}" for f in FIELDS])
def test_bad_config_field_is_named(ckpt, tmp_path, capsys, field, value, pattern):
    _edit_config(ckpt, **{field: value})
    line = refused(capsys, ckpt, tmp_path / "engine", pattern)
    assert "config.json" in line


def test_checkpoint_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    refused(capsys, f, tmp_path / "engine", r"checkpoint .*model\.safetensors is a file, not a directory")


def test_nan_in_another_ranks_expert_fails_the_multi_rank_build_in_one_line(ckpt, tmp_path, capsys):
    """Rank 1's export runs in a child process (builder/rank_process.py): the NaN only rank 1 reads still
    comes back as mtp-build's one-line error, exit 2, with nothing left behind."""
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # expert 3 of 4: EP rank 1's
    _edit_tensors(ckpt, lambda t: t[name].view(-1)[:2].fill_(float("nan")))
    refused(capsys, ckpt, tmp_path / "out", rf"tensor {re.escape(name)} in model\.safetensors has 2 NaN/Inf",
            "--world-size", "2", "--ep-size", "2")  # fmt: skip


def test_checkpoint_without_its_mtp_weights(ckpt, tmp_path, capsys):
    """config.json promises an MTP module whose weights are gone (quantization tools drop them): drafting is refused
    in one line naming --num-draft-tokens 0, which then builds a plain-decoding engine (it used to fail at the end,
    naming the temporary build directory)."""
    from models.engine_format import load_engine_config
    from runtime.core.sampling import SamplingParams
    from runtime.factory import create_engine

    num_layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    _edit_tensors(ckpt, lambda t: [t.pop(k) for k in list(t) if k.startswith(f"model.layers.{num_layers}.")])
    refused(capsys, ckpt, tmp_path / "engine", r"no MTP weights .*--num-draft-tokens 0")
    out = tmp_path / "plain"
    assert cli.main(_argv(ckpt, out, num_draft_tokens=0)) == 0
    cfg = load_engine_config(out)
    assert cfg.model.num_mtp_modules == 0 and set(cfg.graphs[0]) == {"main"}
    params, prompt = SamplingParams(max_tokens=6), [[5, 6, 7, 8]]
    ids = create_engine(out, executor="onnxruntime").generate(prompt, params)[0].output_ids
    assert ids == create_engine(checkpoint=ckpt, executor="torch").generate(prompt, params)[0].output_ids and ids

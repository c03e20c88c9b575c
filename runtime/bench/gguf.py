"""Convert a checkpoint of ours to GGUF with llama.cpp's own converter, so llama.cpp can run the same weights.

    python -m runtime.bench.gguf --checkpoint models/tiny --llama-src build/peers/.../vendor/llama.cpp

Why a wrapper and not `convert_hf_to_gguf.py` directly (docs/BENCHMARKS.md, "llama.cpp"):

* The converter identifies a BPE pre-tokenizer by hashing the token ids of a fixed probe text; our
  tokenizer is our own BPE (models/training trains it), so its hash is in no table and the converter stops
  with "BPE pre-tokenizer was not recognized". Our pre-tokenizer is the plain GPT-2 one (a single
  `ByteLevel` with `use_regex=True`, no prefix space, no normalizer), so its splits are exactly llama.cpp's
  `gpt-2` pre-tokenizer's: we map the unknown hash to `gpt-2`, and only after checking that tokenizer.json
  really is that pre-tokenizer (anything else is refused with a one-line error).
* The `Glm4MoeForCausalLM` vocab writer (`_set_vocab_glm`) looks up GLM-4.5's special tokens (`[gMASK]`,
  `<|user|>`, `<|observation|>`), which our vocabulary does not have; the generic GPT-2 writer
  (`_set_vocab_gpt2`) writes the same BPE vocab and merges and takes eos/pad from tokenizer_config.json.

Everything else (tensor mapping, the MTP/NextN layer, MoE expert merging) is the converter's. The converter
runs in this process with the two patches applied to its classes, so run this module as its own process
(the bench does: `python -m runtime.bench.gguf`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

DEFAULT_OUT_DIR = Path("build/peers/gguf")


class GGUFError(Exception):
    """A one-line reason the conversion cannot run (bad checkpoint, missing llama.cpp sources)."""


def gguf_type(checkpoint: Path) -> str:
    """The GGUF type that holds the checkpoint's matrices exactly and reads the fewest bytes: bf16 for a bf16
    checkpoint (llama.cpp runs it 13-22% faster than f32 here, docs/BENCHMARKS.md), else f32 (the converter
    keeps norms and biases f32 either way)."""
    try:
        cfg = json.loads((checkpoint / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "f32"
    return "bf16" if (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16" else "f32"


def gguf_path(checkpoint: Path, out_dir: Path = DEFAULT_OUT_DIR) -> Path:
    """Where the GGUF of checkpoint goes, named by its type (`gguf_type`)."""
    return out_dir / f"{checkpoint.resolve().name}-{gguf_type(checkpoint)}.gguf"


def check_gpt2_pretokenizer(checkpoint: Path) -> None:
    """Refuse unless tokenizer.json's pre-tokenization is exactly GPT-2's (what mapping the hash to gpt-2 claims)."""
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise GGUFError(f"{checkpoint} has no tokenizer.json; llama.cpp needs the checkpoint's BPE tokenizer")
    tok = json.loads(path.read_text())
    pre, model = tok.get("pre_tokenizer") or {}, tok.get("model") or {}
    ok = (model.get("type") == "BPE" and tok.get("normalizer") is None and pre.get("type") == "ByteLevel"
          and pre.get("use_regex", True) and not pre.get("add_prefix_space", False))  # fmt: skip
    if not ok:
        raise GGUFError(f"{path}: pre-tokenizer {pre.get('type')!r} (model {model.get('type')!r}) is not plain GPT-2 "
                        "ByteLevel BPE, so mapping it to llama.cpp's 'gpt-2' would tokenize differently; "
                        "add its hash to llama.cpp's convert_hf_to_gguf_update.py instead")  # fmt: skip


def patch_converter(conversion) -> None:
    """The two changes described in the module docstring, applied to the imported `conversion` package."""
    from conversion.glm import Glm4MoeModel

    text_model = conversion.TextModel
    original_pre = text_model.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        base_logger = logging.getLogger("hf-to-gguf")
        level = base_logger.level
        base_logger.setLevel(logging.ERROR)  # the converter logs a 12-line warning box before raising
        try:
            return original_pre(self, tokenizer)
        except NotImplementedError:
            check_gpt2_pretokenizer(Path(self.dir_model))
            return "gpt-2"
        finally:
            base_logger.setLevel(level)

    text_model.get_vocab_base_pre = get_vocab_base_pre
    Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()


def convert(checkpoint: Path, llama_src: Path, outfile: Path, force: bool = False) -> Path:
    """Run the vendored convert_hf_to_gguf.py main() on checkpoint (`gguf_type`, MTP layer kept); returns outfile."""
    if not (checkpoint / "config.json").is_file():
        raise GGUFError(f"{checkpoint} has no config.json; pass a Hugging Face checkpoint directory")
    script = llama_src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise GGUFError(f"{script} not found; run `make bench-peers` (it unpacks llama.cpp under build/peers/)")
    check_gpt2_pretokenizer(checkpoint)
    if outfile.is_file() and not force and outfile.stat().st_mtime >= (checkpoint / "model.safetensors").stat().st_mtime:
        return outfile
    outfile.parent.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(llama_src), str(llama_src / "gguf-py")]  # the vendored gguf-py, as the script does
    import importlib.util

    import conversion

    patch_converter(conversion)
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = sys.argv
    sys.argv = [str(script), str(checkpoint), "--outfile", str(outfile), "--outtype", gguf_type(checkpoint)]
    try:
        module.main()
    finally:
        sys.argv = argv
    if not outfile.is_file():
        raise GGUFError(f"the converter finished but wrote no {outfile}")
    return outfile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.gguf", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="Hugging Face checkpoint directory (models/tiny)")
    p.add_argument("--llama-src", type=Path, required=True, help="llama.cpp source tree (the vendored one)")
    p.add_argument("--outfile", type=Path, help=f"default: {DEFAULT_OUT_DIR}/<checkpoint name>-<f32|bf16>.gguf")
    p.add_argument("--force", action="store_true", help="convert even when the GGUF is newer than the checkpoint")
    p.add_argument("--debug", action="store_true", help="show the traceback of a failed conversion")
    args = p.parse_args(argv)
    try:
        out = convert(args.checkpoint, args.llama_src, args.outfile or gguf_path(args.checkpoint), args.force)
    except (GGUFError, OSError, ValueError, NotImplementedError) as e:
        if args.debug:
            raise
        print(f"runtime.bench.gguf: error: {e}", file=sys.stderr)
        return 2
    with contextlib.suppress(OSError):
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

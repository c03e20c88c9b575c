"""A checkpoint's (or engine directory's) tokenizer_config.json and its chat template, and its tokenizer.json, read
and checked in one place: `mtp-build` (and `--check`) refuse a broken file with one line, and `mtp-run` /
`mtp-serve` load them with the same code, so a file that passed the check cannot crash a start-up with a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAME = "tokenizer_config.json"


class TokenizerConfigError(ValueError):
    """tokenizer_config.json or its chat template is broken; the message names the file and the fix."""


def read_chat_template(directory: Path) -> str | None:
    """The `chat_template` source of directory/tokenizer_config.json; None when there is no file or no template."""
    path = Path(directory) / NAME
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerConfigError(f"{path} is not valid JSON ({e}); fix it, or copy it again from the model's "
                                   "original checkpoint") from None  # fmt: skip
    if not isinstance(cfg, dict):
        raise TokenizerConfigError(f"{path} is not a JSON object; fix it, or copy it again from the original checkpoint")
    source = cfg.get("chat_template")
    return source if isinstance(source, str) else None


def compile_chat_template(source: str, where: Path) -> Any:
    """The template as a sandboxed jinja2 Template (the template is data: it is rendered sandboxed)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    except TemplateError as e:
        lineno = getattr(e, "lineno", None)  # TemplateSyntaxError has it; other TemplateErrors do not
        line = f" line {lineno}:" if lineno else ""
        raise TokenizerConfigError(f"{Path(where) / NAME}: chat_template does not compile ({type(e).__name__}:{line} "
                                   f"{e.message}); fix the template or remove the chat_template key") from None  # fmt: skip


def load_chat_template(directory: Path | None) -> Any:
    """The compiled chat template of directory, or None (no file, no template). TokenizerConfigError when broken."""
    if directory is None:
        return None
    source = read_chat_template(directory)
    return None if source is None else compile_chat_template(source, directory)


def check_chat_template(directory: Path) -> None:
    """Raise TokenizerConfigError when directory's tokenizer_config.json or chat template is broken. Without jinja2
    (it comes with the serving extra) the template cannot be compiled here: the JSON is still checked."""
    source = read_chat_template(directory)
    if source is None:
        return
    try:
        import jinja2  # noqa: F401
    except ImportError:
        return
    compile_chat_template(source, directory)


def load_tokenizer_file(directory: Path) -> Any:
    """directory/tokenizer.json as a `tokenizers.Tokenizer`, None when there is none; TokenizerConfigError (one line)
    when it does not load (the tokenizers library raises a bare Exception: "key must be a string at line 1 ...")."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises Exception itself
        why = " ".join(str(e).split())[:200]
        raise TokenizerConfigError(f"{path} does not load ({type(e).__name__}: {why}); copy tokenizer.json again "
                                   "from the model's original checkpoint, or rebuild the engine") from None  # fmt: skip

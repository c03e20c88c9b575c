"""`make demo`: build the shipped 12-layer model's engine (if missing) and run a few prompts with MTP on.

The engine is what plain `mtp-build` writes: with the compiled (AOTInductor) packages wherever this machine can
build them, and `mtp-run` picks the fastest executor the engine has (runtime/factory.py `resolve_executor`). An
engine left by an older demo without runnable packages (or built by another torch or CPU) is rebuilt. Shows the
completions, which executor ran, and the acceptance statistics (mean acceptance length, per-position acceptance).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n        ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    "    for key, value in sorted(mapping.items()):\n        ",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=Path("models/deep"))
    p.add_argument("--engine", type=Path, default=Path("engines/deep"))
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    from builder import cli as build_cli
    from runtime import cli as run_cli

    stale = _why_rebuild(args.engine)
    if stale:
        print(f"building {args.engine} from {args.checkpoint} ({stale}) ...")
        rc = build_cli.main(["--checkpoint", str(args.checkpoint), "--output", str(args.engine), "--force",
                             "--num-draft-tokens", str(args.num_draft_tokens), "--kv-block-size", "16"])  # fmt: skip
        if rc:
            return rc
    run_args = ["--engine", str(args.engine), "--max-tokens", str(args.max_tokens),
                "--num-draft-tokens", str(args.num_draft_tokens)]  # fmt: skip
    for prompt in PROMPTS:
        run_args += ["--prompt", prompt]
    return run_cli.main(run_args)


def _why_rebuild(engine: Path) -> str | None:
    """Why the demo engine must be built (again), or None when it can run as it is."""
    if not (engine / "config.json").is_file():
        return "not built yet"
    from models.engine_format import EngineDirError, load_engine_config
    from models.engine_format.compiled import compiled_problem

    try:
        problem = compiled_problem(load_engine_config(engine))
    except EngineDirError as e:
        return f"unreadable: {e}"
    return problem


if __name__ == "__main__":
    sys.exit(main())

"""`make demo`: build the shipped 12-layer model's engine (if missing) and run a few prompts with MTP on.

Shows the streamed completions and the acceptance statistics (mean acceptance length, per-position
acceptance) on the onnxruntime executor.
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

    if not (args.engine / "config.json").is_file():
        print(f"building {args.engine} from {args.checkpoint} ...")
        rc = build_cli.main(["--checkpoint", str(args.checkpoint), "--output", str(args.engine),
                             "--num-draft-tokens", str(args.num_draft_tokens), "--kv-block-size", "16"])  # fmt: skip
        if rc:
            return rc
    run_args = ["--engine", str(args.engine), "--max-tokens", str(args.max_tokens),
                "--num-draft-tokens", str(args.num_draft_tokens)]  # fmt: skip
    for prompt in PROMPTS:
        run_args += ["--prompt", prompt]
    return run_cli.main(run_args)


if __name__ == "__main__":
    sys.exit(main())

"""Path rules of an engine directory: every path the config or manifest names must stay inside it."""

from __future__ import annotations

from pathlib import Path, PurePosixPath


class EngineDirError(ValueError):
    """An engine directory that must not be loaded; the message names the problem and the fix."""


def safe_path(root: Path, rel: str) -> Path:
    """root/rel, refused unless it is a relative path that (symlinks resolved) stays inside root.

    A config edited to point at ../other/model.onnx or /etc/x must not be opened: the checksums only
    vouch for files inside the directory.
    """
    if not isinstance(rel, str) or not rel:
        raise EngineDirError(f"engine {root} names an empty or non-string path {rel!r}; rebuild the engine")
    if PurePosixPath(rel).is_absolute() or Path(rel).is_absolute():
        raise EngineDirError(f"engine {root} names absolute path {rel!r}; engine paths must be relative to the "
                             "engine directory: rebuild the engine")  # fmt: skip
    base = root.resolve()
    full = (base / rel).resolve()
    if not full.is_relative_to(base):
        raise EngineDirError(f"engine {root} names path {rel!r}, which leaves the engine directory (resolves to "
                             f"{full}); refusing to open it: rebuild the engine or copy it without outside links")  # fmt: skip
    return root / rel


def rank_dir(rank: int) -> str:
    return f"rank{rank}"

"""The compiled CPU artifacts of an engine (AOTInductor packages): their config.json record and load checks.

`mtp-build --compile aoti` adds, per rank and graph, a `.pt2` package next to the ONNX files (graph kind
`aoti` in `graphs`) and records `build.compiled`: the Inductor settings, the torch version and the CPU's
vector ISA it was compiled for. A package is native code for one torch build and one ISA: `compiled_problem`
says why this installation cannot run it (the runtime then refuses with one line, or `auto` falls back to
ONNX Runtime). The ONNX graphs stay in the directory either way (the interchange for TensorRT). `load_package` is
the one place a package is loaded (the compiled executor, `mtp-build --check`): a failure is one line. A rank's
packages read their weights from the rank's one weight store (weight_store.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.engine_format import weight_store
from models.engine_format.config import EngineConfig
from models.engine_format.paths import EngineDirError

if TYPE_CHECKING:
    from plugins.gdn_pool import GDNPoolGeometry

AOTI_KIND = "aoti"  # graph kind in config.json's `graphs`, and the package name suffix (main.aoti.pt2)
# `build.compiled.fp8` of an engine whose packages store FP8 release weights as released (absent otherwise): this
# format, plus `ops`, the mtp ops those packages call for it, which the installation that runs them must have.
FP8_FORMAT: dict[str, Any] = {"fmt": "e4m3", "weight_block_size": [128, 128]}
# `build.compiled.int8` of an engine built with `mtp-build --quantize int8`: this format, `ops` as for fp8, and
# `weights`, the checkpoint names of the weights stored int8 (`mtp-build --check` quantizes the same ones).
INT8_FORMAT: dict[str, Any] = {"fmt": "int8", "scheme": "symmetric per output channel, fp32 scale = max|w| / 127"}
# `build.compiled.int4` of an engine built with `mtp-build --quantize int4` (its other quantized weights are in `int8`):
# this format, `group_size` (`--int4-group-size`: input features per scale), `ops` and `weights` as for int8
# (plugins/reference.py quantize_int4 with that group_size).
INT4_FORMAT: dict[str, Any] = {"fmt": "int4", "packing": "two per byte, column 2i in the low nibble",
                               "scheme": "symmetric per group of input features, fp32 scale = max|w| / 7"}  # fmt: skip


def host_isa() -> str:
    """The vector ISA Inductor picks on this CPU (e.g. "avx512"), which compiled packages are built for."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # torch only when asked (see compiled_problem)

    return str(pick_vec_isa()) or "none"


def compiled_info(cfg: EngineConfig) -> dict[str, Any] | None:
    """`build.compiled` when every graph of every rank has a package, else None (an engine built without it)."""
    info = cfg.build.get("compiled")
    if not isinstance(info, dict):
        return None
    if not all(AOTI_KIND in kinds for per_graph in cfg.graphs for kinds in per_graph.values()):
        return None
    return info


def baked_state(cfg: EngineConfig) -> GDNPoolGeometry | None:
    """A hybrid engine's GDN state pool as its compiled packages bake it: config.json `state` with
    `build.compiled.state_slots` slots (the request slots plus the default prefix-cache snapshots; the slot count
    sets every layer's address, so the compiled executor and `--check` allocate exactly this). None: not hybrid."""
    if cfg.state is None:
        return None
    slots = int((compiled_info(cfg) or {}).get("state_slots", cfg.state.num_slots))
    return dataclasses.replace(cfg.state.geometry(), num_slots=slots)


def compiled_problem(cfg: EngineConfig) -> str | None:
    """Why this installation cannot run the engine's compiled packages, or None when it can."""
    import torch  # here: the control plane (runtime.factory) imports this module without torch

    info = compiled_info(cfg)
    if info is None:
        return f"engine {cfg.path} has no compiled packages (build it with `mtp-build --compile aoti`)"
    if info.get("torch_version") != torch.__version__:
        return (f"engine {cfg.path}'s compiled packages were built with torch {info.get('torch_version')}, this "
                f"installation has {torch.__version__}; rebuild with `mtp-build --compile aoti --force`")
    if info.get("isa") != host_isa():
        return (f"engine {cfg.path}'s compiled packages were built for CPU ISA {info.get('isa')!r}, this CPU has "
                f"{host_isa()!r}; rebuild on this machine with `mtp-build --compile aoti --force`")
    for key, what in (("fp8", "FP8"), ("int8", "int8"), ("int4", "int4")):
        fmt = info.get(key)
        if fmt is None:
            continue
        import plugins.cpp_ops  # noqa: F401  (the mtp ops of this installation)
        import plugins.moe_ep  # noqa: F401  (and their exchange forms, a multi-rank engine's)

        ops = fmt.get("ops") if isinstance(fmt, dict) else None
        missing = [op for op in ops or [] if not hasattr(torch.ops.mtp, str(op))] if isinstance(ops, list) else ["?"]
        if missing:
            return (f"engine {cfg.path}'s compiled packages keep {what} weights and call mtp::{missing[0]}, which this "
                    "installation does not have; install the mtp-engine version that built it, or rebuild with "
                    "`mtp-build --compile aoti --force`")
    return None


def extraction_dir() -> Path:
    """Where AOTInductor unpacks a package to load it: the C++ loader's temporary directory (libstdc++'s
    temp_directory_path: $TMPDIR, $TMP, $TEMP, $TEMPDIR, else /tmp), not Python's tempfile (which skips a bad one)."""
    for var in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path("/tmp")


def load_package(cfg: EngineConfig, path: Path) -> Any:
    """The AOTInductor package at `path` (a torch AOTICompiledModel), or EngineDirError in one line: a damaged
    package (it is not a readable zip: rebuild), or one that could not be unpacked (a full or unwritable
    temporary directory: the line names it and TMPDIR).

    torch's loader unpacks every package into a fresh aotinductor_* folder of the temporary directory (TMPDIR) and
    removes it only when the process exits normally: a rank that leaves through the watchdog (os._exit) or is
    killed left every package's folder behind (measured: 3 folders, one per graph, 2-7 MB each on models/tiny; a
    real model's weights). So each load unpacks into a private folder of the temporary directory, removed as soon
    as the package is loaded (its code is mapped; nothing is read from the folder after the load) or its load
    failed. Where no private folder can be made (TMPDIR is not a writable directory) the load goes ahead as
    before and fails with the line below; folders a failed load left are removed.

    The package's weights are its rank's weight store's (models/engine_format/weight_store.py), mapped once per
    process and handed to it without a copy; in an engine built before the store, they are read from the .pt2
    itself (builder/compile_aoti.py PACKAGE_WEIGHTS), not unpacked (`_load_with_weights`)."""
    rel = str(path.relative_to(cfg.path)) if path.is_relative_to(cfg.path) else path.name
    tmp = extraction_dir()
    before = _aoti_folders(tmp)
    try:
        private: Path | None = Path(tempfile.mkdtemp(prefix="mtp_aoti_", dir=tmp))
    except OSError:
        private = None
    saved = os.environ.get("TMPDIR")
    if private is not None:
        os.environ["TMPDIR"] = str(private)  # the loader reads it at the call (std::filesystem::temp_directory_path)
    try:
        return _load_with_weights(path)
    except RuntimeError as e:
        own = path.name.removesuffix(".pt2")
        for folder in _aoti_folders(tmp) - before:
            with contextlib.suppress(OSError):
                if {p.name for p in folder.iterdir()} <= {own}:
                    shutil.rmtree(folder)
        reason = " ".join(str(e).split())
        reason = reason if len(reason) <= 160 else f"{reason[:80]} ... {reason[-70:]}"  # both ends say what failed
        damaged = _zip_problem(path)
        if damaged is not None:
            raise EngineDirError(f"engine file {rel} in {cfg.path} is damaged ({damaged}); rebuild it with "
                                 f"`mtp-build --checkpoint CKPT --output {cfg.path} --force`") from None  # fmt: skip
        size_mb = max(1, -(-path.stat().st_size // (1 << 20)))
        raise EngineDirError(f"engine file {rel} could not be unpacked into the temporary directory {tmp} ({reason}); "
                             f"the package is intact: free space there (it needs about {size_mb} MB per package) or "
                             "point TMPDIR at a writable directory with room") from None  # fmt: skip
    finally:
        if private is not None:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved
            shutil.rmtree(private, ignore_errors=True)


def _load_with_weights(path: Path) -> Any:
    """The package with its weights: from its rank's store (models/engine_format/weight_store.py: mapped once per
    process, shared by the rank's packages, handed to each as they are: `user_managed`, no copy), or, in an engine
    built before the store, those it keeps in data/weights (loaded once per package and handed over the same way)
    or inside its .so (the loader copies them)."""
    from torch.export.pt2_archive._package import AOTINDUCTOR_DIR, PT2ArchiveReader, _load_aoti, load_pt2

    with PT2ArchiveReader(str(path)) as reader:
        store_map = weight_store.read_store_map(reader)
        if store_map is None:
            return load_pt2(str(path), load_weights_from_disk=True).aoti_runners["model"]
        configs = {name.split("/")[-2]: json.loads(reader.read_string(name)) for name in reader.get_file_names()
                   if name.startswith(AOTINDUCTOR_DIR) and name.endswith(weight_store.WEIGHTS_CONFIG)}  # fmt: skip
    store = weight_store.open_store(path.parent / store_map["store"])
    runner = _load_aoti(str(path), "model", False, 1, -1)  # as load_pt2 does, without its weights
    runner.load_constants(weight_store.constants(store, store_map, configs["model"]), check_full_update=True,
                          user_managed=True)  # fmt: skip
    return runner


def _aoti_folders(tmp: Path) -> set[Path]:
    try:
        return {p for p in tmp.iterdir() if p.name.startswith("aotinductor_") and p.is_dir()}
    except OSError:  # not a directory (then nothing was unpacked there either)
        return set()


def _zip_problem(path: Path) -> str | None:
    """Why the package is not an intact zip (a .pt2 is one), or None."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f"not a readable package: {' '.join(str(e).split())[:120]}"
    return None if bad is None else f"its member {bad} fails its CRC check"

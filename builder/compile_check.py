"""`mtp-build --check` of an engine's compiled packages: they load here and compute what the torch model computes.

The checksums (models/engine_format) already prove the packages are the files the build wrote; this proves
they still run on this installation (torch version, CPU ISA, plugin ops) and agree with models/glm4_moe.py on
a probe batch: a mixed main step (a prefill request, a verify request, a padded request), one draft depth and
one commit write, each on its own pool and on the torch model's pool, compared output by output and plane by
plane. The torch model is rebuilt from the checkpoint the engine records; without it the probe is skipped
(said in the returned line).
"""

from __future__ import annotations

from pathlib import Path

import torch

import plugins.mla_ops  # noqa: F401  (the packages call the plugin ops by name)
import plugins.ops  # noqa: F401
from builder.graphs import WRAPPERS
from builder.options import BuildError
from models.engine_format import EngineConfig
from models.engine_format.compiled import AOTI_KIND, compiled_info, compiled_problem
from plugins.kv_pool import allocate_pool, pool_address

TOLERANCE = 1e-4  # fp32 math on both sides: differences are summation order only (~1e-6 measured)


def probe_inputs(cfg: EngineConfig) -> dict[str, tuple[torch.Tensor, ...]]:
    """Step inputs of each graph (without the pool address) for a small mixed batch within the engine's limits."""
    k, bs, width = cfg.num_draft_tokens, cfg.kv.block_size, cfg.kv.table_width
    g = torch.Generator().manual_seed(0)
    prefill, verify = min(5, cfg.limits.max_num_tokens - (1 + k)), 1 + k
    tables = torch.full((3, width), -1, dtype=torch.int32)
    tables[0, : -(-prefill // bs)] = torch.arange(1, 1 + -(-prefill // bs))
    last = cfg.kv.num_blocks - 1
    tables[1, :2] = torch.tensor([last - 1, last])  # verify rows at positions bs-1 ..: crosses a block boundary
    counts = torch.tensor([prefill, verify, 0], dtype=torch.int32)
    kv_lens = torch.tensor([prefill, bs - 1 + verify, 0], dtype=torch.int32)
    t = prefill + verify
    positions = torch.cat([torch.arange(prefill), torch.arange(bs - 1, bs - 1 + verify)])
    ids = torch.randint(0, cfg.model.vocab_size, (t,), generator=g)
    h = cfg.model.hidden_size
    out: dict[str, tuple[torch.Tensor, ...]] = {
        "main": (ids, positions, counts, kv_lens, tables, torch.arange(t)),
    }
    if cfg.model.num_mtp_modules:
        hidden = torch.randn(3, h, generator=g)
        out["mtp_draft"] = (hidden, ids[:3], torch.tensor([prefill - 1, bs, 0]), torch.tensor([1, 1, 0], dtype=torch.int32),
                            tables)  # fmt: skip
        out["mtp_commit"] = (torch.randn(t, h, generator=g), ids, counts, torch.tensor([0, bs - 1, 0], dtype=torch.int32),
                             tables)  # fmt: skip
    return out


def check_compiled(cfg: EngineConfig, rank: int = 0) -> str:
    """One line saying what was verified; BuildError (one line) when a package fails to load or disagrees."""
    if compiled_info(cfg) is None:
        return "no compiled packages"
    problem = compiled_problem(cfg)
    if problem is not None:
        raise BuildError(problem)
    checkpoint = Path(cfg.checkpoint.get("path", ""))
    if not (checkpoint / "config.json").is_file():
        return f"compiled packages load-checked only: the checkpoint {checkpoint} is not here to compare against"
    from models.checkpoint import load_model

    model, _ = load_model(checkpoint)
    model = model.eval().fuse()
    geom = cfg.kv.geometry()
    ours, theirs = allocate_pool(geom), allocate_pool(geom)
    worst = 0.0
    with torch.inference_mode():
        for name, inputs in probe_inputs(cfg).items():
            path = cfg.graph_file(rank, name, AOTI_KIND)
            assert path is not None
            try:
                package = torch._inductor.aoti_load_package(str(path))
                got = package(*inputs, pool_address(ours))
            except Exception as e:  # a package that does not load or run here: one line naming it
                raise BuildError(f"compiled package {path.name} of {cfg.path} does not run here ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]}); rebuild with `mtp-build --compile aoti --force`") from e  # fmt: skip
            want = WRAPPERS[name](model, geom)(*inputs, pool_address(theirs))
            for a, b in zip(_tuple(got), _tuple(want), strict=True):
                worst = max(worst, _diff(a, b))
            worst = max(worst, _diff(ours, theirs))
            if worst > TOLERANCE:
                raise BuildError(f"compiled package {path.name} of {cfg.path} disagrees with the torch model on the "
                                 f"probe batch (max |diff| {worst:.2e} > {TOLERANCE}); rebuild with `mtp-build "
                                 "--compile aoti --force`")  # fmt: skip
    return f"compiled packages match the torch model on a probe batch (max |diff| {worst:.1e}, pools equal)"


def _tuple(x) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.dtype.is_floating_point:
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

"""The `compiled` executor: runs an engine's AOTInductor packages (`mtp-build --compile aoti`) on CPU.

One execution context per graph (main / verify, draft depth, commit): the loaded package plus preallocated,
stable-address input buffers sized for the engine's limits. A step copies its numpy arrays into the leading
part of each buffer and calls the package on views of them (docs/ARCHITECTURE.md invariant 10: captured
execution; the packages were compiled with dynamic `tokens` / `requests` dims, so any step within the limits
replays the same code, no per-batch bucket and no padding). No Python runs between the kernels of a step
except the plugin ops' own bodies (C++ once registered by the C++ plugin library; the op names are the same).

The pool is allocated here with exactly the geometry the packages were compiled for (its `num_blocks` is
baked into their plugin calls): a runtime `num_blocks` up to the built one uses the first blocks of it. A hybrid
(Gated DeltaNet) engine's main package also takes the state slots and the state pools' addresses; its state pool
is allocated with the slot count the packages bake (`build.compiled.state_slots`: the request slots plus the
default prefix-cache snapshots), of which a run may use fewer snapshots (runtime/core/state_pool.py).

Multi-rank (mpirun): each rank loads its own rank's packages. The collectives inside them (`mtp::all_reduce`,
`mtp::all_gather`, the MoE exchange behind `mtp::moe_experts`) are Python ops over mpi4py; a package calls them
through the torch dispatcher like any op without a C shim (AOTInductor's proxy executor), so a rank issues the
same collectives in the same order as the torch and ONNX Runtime executors, and runtime/multirank drives it
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import plugins.collectives  # noqa: F401  (registers the ops the packages call by name; the collectives: multi-rank)
import plugins.mla_ops  # noqa: F401
import plugins.ops  # noqa: F401
from models.engine_format import EngineConfig, EngineDirError, load_engine_config
from models.engine_format.compiled import AOTI_KIND, baked_state, compiled_problem, load_package
from models.engine_format.graph_io import (
    DRAFT_GRAPH,
    FUSED_DRAFT,
    FUSED_KIND,
    GraphSpec,
    draft_graph,
    draft_graphs,
    graph_spec,
)
from models.gdn import GDNStatePool
from plugins.kv_pool import allocate_pool, pool_address
from runtime.executors.base import (
    CommitInput,
    DraftInput,
    DraftOutput,
    FusedDraftInput,
    MainInput,
    MainOutput,
    draft_module,
)
from runtime.executors.torch_executor import warn_spinning_threads


@dataclass
class ExecutionContext:
    """A compiled graph and its stable input buffers (flat, so any leading [R, MB] block is a contiguous view)."""

    spec: GraphSpec
    run: object  # AOTIModelPackageLoader.boxed_run: list of tensors -> list of tensors
    buffers: dict[str, torch.Tensor]  # step input name -> flat preallocated tensor
    arrays: dict[str, np.ndarray]  # the same memory as numpy (the refill path)
    pool_ptrs: list[torch.Tensor]  # after the step inputs: the KV pool's address (a hybrid main: + conv, ssm)
    # (input, shape) -> its (numpy, torch) views of the buffer's leading elements. Building the views was most of a
    # call's Python time (~30 us of a 35 us one-row commit; a draft depth is ~0.3 ms): the buffers never move, so a
    # shape seen once is reused (a few hundred shapes at most: rows <= the engine's limits)
    views: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.names = self.spec.step_inputs  # a property that builds its tuple on every read

    def __call__(self, inp: object) -> list[torch.Tensor]:
        args = []
        for name in self.names:
            value = np.asarray(getattr(inp, name))
            view = self.views.get((name, value.shape)) or self._view(name, value.shape)
            np.copyto(view[0], value, casting="same_kind")
            args.append(view[1])
        args += self.pool_ptrs
        return self.run(args)  # type: ignore[operator]

    def _view(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, torch.Tensor]:
        n, buf = int(np.prod(shape)), self.arrays[name]
        if n > buf.size:
            raise ValueError(f"{self.spec.name}: {name} has {n} elements, the engine's limits allow {buf.size}")
        view = self.views[(name, shape)] = (buf[:n].reshape(shape), self.buffers[name][:n].view(shape))
        return view


class CompiledExecutor:
    def __init__(self, engine_dir: str | Path, rank: int = 0, num_blocks: int | None = None,
                 mtp_modules: str = "per-depth") -> None:  # fmt: skip
        self.config: EngineConfig = load_engine_config(engine_dir)
        cfg = self.config
        # the draft graph of depth d: module d's where the engine has one per module (graph_io.py draft_graphs)
        self.num_draft_graphs, self.mtp_modules = len(draft_graphs(cfg.model)), mtp_modules
        problem = compiled_problem(cfg)
        if problem is not None:
            raise EngineDirError(f"--executor compiled: {problem}")
        if not 0 <= rank < cfg.world_size:
            raise EngineDirError(f"rank {rank} is outside engine {cfg.path}'s world_size={cfg.world_size}; launch it "
                                 f"with mpirun -np {cfg.world_size}")  # fmt: skip
        blocks = num_blocks if num_blocks is not None else cfg.kv.num_blocks
        if not 2 <= blocks <= cfg.kv.num_blocks:
            raise ValueError(f"num_blocks={blocks}: the compiled engine's pool has {cfg.kv.num_blocks} blocks (baked "
                             "into its packages) and needs at least 2; lower num_blocks or rebuild with larger limits")  # fmt: skip
        warn_spinning_threads()
        self.geom = cfg.kv.geometry(cfg.kv.num_blocks)
        self.pool = allocate_pool(self.geom)  # owned here: the packages only see its address
        ptr = pool_address(self.pool)
        self.state: GDNStatePool | None = None  # a hybrid model's recurrent state (runtime/core/state_pool.py)
        if (state := baked_state(cfg)) is not None:
            self.state = GDNStatePool.of(state)
        self.hidden_size, self.vocab_size = cfg.model.hidden_size, cfg.model.vocab_size
        self.contexts = {name: self._context(name, rank, ptr) for name in cfg.graphs[rank]}
        # the K draft depths in one call (builder/fused_draft.py), when built and its modules are this policy's;
        # loaded only when the engine will use it (`load_fused_draft`): it costs memory (its code; an engine built
        # before the weight store also its own copy of the draft's weights)
        self.fused_draft_depths = 0
        fused = cfg.graph_file(rank, DRAFT_GRAPH, FUSED_KIND)
        k = cfg.num_draft_tokens
        modules = [draft_module(d, self.num_draft_graphs, mtp_modules) for d in range(k)]
        if fused is not None and modules == [draft_module(d, self.num_draft_graphs) for d in range(k)]:
            self._fused = (rank, ptr, fused)
            self.fused_draft_depths = k

    def load_fused_draft(self) -> None:
        """Load the fused draft package (once), before the engine's first step uses it."""
        if FUSED_DRAFT not in self.contexts:
            self.contexts[FUSED_DRAFT] = self._context(FUSED_DRAFT, *self._fused)

    def _context(self, name: str, rank: int, ptr: torch.Tensor, path: Path | None = None) -> ExecutionContext:
        """path: the package, when it is not graph `name`'s AOTI_KIND file (the fused draft loop's)."""
        cfg, spec = self.config, graph_spec(name, self.state is not None)
        ptrs = [ptr]
        if name == "main" and self.state is not None:
            ptrs += [self.state.ref.conv_ptr, self.state.ref.ssm_ptr]
        path = path or cfg.graph_file(rank, name, AOTI_KIND)
        assert path is not None
        loader = load_package(cfg, path).loader
        lim, width = cfg.limits, cfg.kv.table_width
        rows = {"tokens": lim.max_num_tokens, "logit_rows": lim.max_num_tokens, "rows": lim.max_num_tokens,
                "requests": lim.max_batch, "max_blocks": width, "H": cfg.model.hidden_size}  # fmt: skip
        buffers = {}
        for inp in spec.step_inputs:
            size = int(np.prod([rows[d] if isinstance(d, str) else d for d in spec.dims[inp]]))
            buffers[inp] = torch.zeros(size, dtype=getattr(torch, spec.dtypes[inp]))
        arrays = {n: b.numpy() for n, b in buffers.items()}
        return ExecutionContext(spec, loader.boxed_run, buffers, arrays, ptrs)

    def _graph(self, name: str) -> ExecutionContext:
        if name not in self.contexts:
            raise RuntimeError(f"engine {self.config.path} has no {name} graph (built without MTP?)")
        return self.contexts[name]

    def run_main(self, inp: MainInput) -> MainOutput:
        hidden, logits = self._graph("main")(inp)
        return MainOutput(hidden.numpy(), logits.numpy())

    def run_draft(self, inp: DraftInput) -> DraftOutput:
        module = draft_module(inp.depth, self.num_draft_graphs, self.mtp_modules)
        hidden, logits = self._graph(draft_graph(module))(inp)
        return DraftOutput(hidden.numpy(), logits.numpy())

    def run_fused_draft(self, inp: FusedDraftInput) -> np.ndarray:
        """int64 [R, K] drafts of the K depths in one call (only when fused_draft_depths == K > 0)."""
        self.load_fused_draft()
        return self._graph(FUSED_DRAFT)(inp)[0].numpy()

    def run_commit(self, inp: CommitInput) -> int:
        return int(self._graph("mtp_commit")(inp)[0][0])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        with torch.no_grad():
            for src, dst in pairs:
                self.pool[:, :, dst] = self.pool[:, :, src]

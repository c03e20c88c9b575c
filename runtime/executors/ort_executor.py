"""The `onnxruntime` executor: runs a built engine directory's ONNX graphs on CPU.

Owns one InferenceSession per graph of one rank and the KV pool those graphs write through. The engine
directory is checked first (models.engine_format.load_engine_config: schema, manifest checksums, paths,
plugin versions, ranks, config vs graphs). Plugin nodes are bound to the onnxruntime-extensions Python ops
by an in-memory domain rewrite (plugins.ort_ops.prepare_for_ort); the files on disk are not touched. The
pool is allocated here, kept alive for the executor's lifetime (its address is baked into every step's
`kv_pool_ptr`), and may be sized differently from the build default: the plugin nodes' `num_blocks`
attribute is then rewritten in memory too, since it is part of the pool geometry the ops index with (likewise the
GdnStep nodes' `num_slots` when the state pool gets prefix-cache snapshot slots).
Feeds come from the graph I/O spec (models.engine_format.graph_io), outputs are matched to it by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from models.engine_format import EngineConfig, EngineDirError, load_engine_config
from models.engine_format.graph_io import POOL_INPUT, STATE_INPUTS, draft_graph, draft_graphs, feeds, graph_spec
from models.engine_format.ort_session import SESSION_OPTIONS, session_options
from models.gdn import GDNStatePool
from plugins.kv_pool import allocate_pool, pool_address
from plugins.names import GDN_STEP, POOL_NODES
from plugins.ort_ops import prepare_for_ort
from runtime.executors.base import CommitInput, DraftInput, DraftOutput, MainInput, MainOutput, draft_module


def _set_attr(model: onnx.ModelProto, op_types: Collection[str], name: str, value: int) -> None:
    for node in model.graph.node:
        if node.op_type in op_types:
            for attr in node.attribute:
                if attr.name == name:
                    attr.i = value


class OrtExecutor:
    def __init__(self, engine_dir: str | Path, rank: int = 0, num_blocks: int | None = None,
                 intra_op_threads: int | None = None, num_state_snapshots: int = 0,
                 mtp_modules: str = "per-depth") -> None:  # fmt: skip
        self.config: EngineConfig = load_engine_config(engine_dir)
        cfg = self.config
        # the draft graph of depth d: module d's where the engine has one per module (graph_io.py draft_graphs)
        self.num_draft_graphs, self.mtp_modules = len(draft_graphs(cfg.model)), mtp_modules
        if not 0 <= rank < cfg.world_size:
            raise EngineDirError(f"rank {rank} is outside the engine's world_size={cfg.world_size}")
        if cfg.dtype != "float32":
            raise EngineDirError(f"the onnxruntime executor runs float32 engines only; {cfg.path} is {cfg.dtype}")
        if not cfg.onnx_weights:
            raise EngineDirError(f"engine {cfg.path} is compiled and carries no ONNX weights, so the onnxruntime "
                                 "executor cannot run it: run it with --executor compiled (the default), or rebuild "
                                 "it with `mtp-build --compile aoti --keep-onnx --force` to run it on onnxruntime too")  # fmt: skip
        blocks = num_blocks if num_blocks is not None else cfg.kv.num_blocks
        if blocks < 2:
            raise ValueError(f"num_blocks={blocks}: the pool needs the null block 0 plus at least one block")
        self.geom = cfg.kv.geometry(blocks)
        self.pool = allocate_pool(self.geom)  # owned here: the sessions only see its address
        self._ptr = pool_address(self.pool).numpy()
        self._addresses = {POOL_INPUT: self._ptr}
        # Hybrid models: the Gated DeltaNet state pool, exactly the geometry the GdnStep nodes were built with
        # (config.json `state`: max_batch x (K + 2) slots) plus the prefix cache's state snapshots, whose slot count
        # the GdnStep nodes get rewritten in memory, like num_blocks; runtime/core/state_pool.py hands out the slots.
        geom = None if cfg.state is None else cfg.state.geometry()
        if geom is not None and num_state_snapshots:
            geom = dataclasses.replace(geom, num_slots=geom.num_slots + num_state_snapshots)
        self.state = GDNStatePool.of(geom) if geom is not None else None
        if self.state is not None:
            refs = self.state.ref
            self._addresses |= dict(zip(STATE_INPUTS, (refs.conv_ptr.numpy(), refs.ssm_ptr.numpy()), strict=True))
        self.hidden_size, self.vocab_size = cfg.model.hidden_size, cfg.model.vocab_size
        recorded = dict(cfg.build.get("ort_session_options", SESSION_OPTIONS))
        if intra_op_threads is not None:  # a runtime choice (machine and neighbours), not part of the engine
            recorded["intra_op_num_threads"] = intra_op_threads
        self.sessions: dict[str, ort.InferenceSession] = {}
        for name in cfg.graphs[rank]:
            path = cfg.graph_file(rank, name, "ort_optimized") or cfg.graph_file(rank, name, "onnx")
            assert path is not None
            model = prepare_for_ort(onnx.load(str(path), load_external_data=False))
            if blocks != cfg.kv.num_blocks:
                _set_attr(model, POOL_NODES, "num_blocks", blocks)
            if self.state is not None and cfg.state is not None and self.state.num_slots != cfg.state.num_slots:
                _set_attr(model, (GDN_STEP,), "num_slots", self.state.num_slots)
            self.sessions[name] = ort.InferenceSession(
                model.SerializeToString(), session_options(recorded, path.parent), providers=recorded["providers"]
            )

    def _run(self, graph: str, inp: object) -> dict[str, np.ndarray]:
        if graph not in self.sessions:
            raise RuntimeError(f"engine {self.config.path} has no {graph} graph (built without MTP?)")
        spec = graph_spec(graph, self.state is not None)
        addresses = {name: self._addresses[name] for name in spec.inputs if name in self._addresses}
        outs = self.sessions[graph].run(list(spec.outputs), {**feeds(spec, inp), **addresses})
        return dict(zip(spec.outputs, outs, strict=True))

    def run_main(self, inp: MainInput) -> MainOutput:
        return MainOutput(**self._run("main", inp))

    def run_draft(self, inp: DraftInput) -> DraftOutput:
        module = draft_module(inp.depth, self.num_draft_graphs, self.mtp_modules)
        return DraftOutput(**self._run(draft_graph(module), inp))

    def run_commit(self, inp: CommitInput) -> int:
        return int(self._run("mtp_commit", inp)["rows_written"][0])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        with torch.no_grad():
            for src, dst in pairs:
                self.pool[:, :, dst] = self.pool[:, :, src]

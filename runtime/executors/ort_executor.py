"""The `onnxruntime` executor: runs a built engine directory's ONNX graphs on CPU.

Owns one InferenceSession per graph of one rank and the KV pool those graphs write through. The engine
directory is checked first (builder.engine_dir.load_engine_config: schema, plugin versions, ranks,
checksums). Plugin nodes are bound to the onnxruntime-extensions Python ops by an in-memory domain rewrite
(plugins.ort_ops.prepare_for_ort); the files on disk are not touched. The pool is allocated here, kept
alive for the executor's lifetime (its address is baked into every step's `kv_pool_ptr`), and may be
sized differently from the build default: the plugin nodes' `num_blocks` attribute is then rewritten in
memory too, since it is part of the pool geometry the ops index with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from builder.engine_dir import EngineConfig, EngineDirError, load_engine_config
from builder.ort_build import SESSION_OPTIONS, session_options
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from plugins.ort_ops import PLUGIN_OPS, prepare_for_ort
from runtime.executors.base import CommitInput, DraftInput, DraftOutput, MainInput, MainOutput


def _set_num_blocks(model: onnx.ModelProto, num_blocks: int) -> None:
    for node in model.graph.node:
        if node.op_type in PLUGIN_OPS:
            for attr in node.attribute:
                if attr.name == "num_blocks":
                    attr.i = num_blocks


class OrtExecutor:
    def __init__(self, engine_dir: str | Path, rank: int = 0, num_blocks: int | None = None) -> None:
        self.config: EngineConfig = load_engine_config(engine_dir)
        cfg = self.config
        if not 0 <= rank < cfg.world_size:
            raise EngineDirError(f"rank {rank} is outside the engine's world_size={cfg.world_size}")
        if cfg.dtype != "float32":
            raise EngineDirError(f"the onnxruntime executor runs float32 engines only; {cfg.path} is {cfg.dtype}")
        kv = cfg.kv
        blocks = num_blocks if num_blocks is not None else kv["default_num_blocks"]
        if blocks < 2:
            raise ValueError(f"num_blocks={blocks}: the pool needs the null block 0 plus at least one block")
        self.geom = KVPoolGeometry(kv["num_planes"], blocks, kv["block_size"], kv["num_kv_heads"], kv["head_dim"],
                                   kv["dtype_code"])  # fmt: skip
        self.pool = allocate_pool(self.geom)  # owned here: the sessions only see its address
        self._ptr = pool_address(self.pool).numpy()
        self.hidden_size, self.vocab_size = cfg.model.hidden_size, cfg.model.vocab_size
        recorded = cfg.build.get("ort_session_options", SESSION_OPTIONS)
        self.sessions: dict[str, ort.InferenceSession] = {}
        for name in cfg.graphs[rank]:
            path = cfg.graph_file(rank, name, "ort_optimized") or cfg.graph_file(rank, name, "onnx")
            assert path is not None
            model = prepare_for_ort(onnx.load(str(path), load_external_data=False))
            if blocks != kv["default_num_blocks"]:
                _set_num_blocks(model, blocks)
            self.sessions[name] = ort.InferenceSession(
                model.SerializeToString(), session_options(recorded, path.parent), providers=recorded["providers"]
            )

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if graph not in self.sessions:
            raise RuntimeError(f"engine {self.config.path} has no {graph} graph (built without MTP?)")
        feeds["kv_pool_ptr"] = self._ptr
        return self.sessions[graph].run(None, feeds)

    def run_main(self, inp: MainInput) -> MainOutput:
        hidden, logits = self._run("main", {
            "input_ids": np.asarray(inp.input_ids, np.int64), "positions": np.asarray(inp.positions, np.int64),
            "q_counts": np.asarray(inp.q_counts, np.int32), "kv_lens": np.asarray(inp.kv_lens, np.int32),
            "block_tables": np.asarray(inp.block_tables, np.int32), "logit_rows": np.asarray(inp.logit_rows, np.int64),
        })  # fmt: skip
        return MainOutput(hidden, logits)

    def run_draft(self, inp: DraftInput) -> DraftOutput:
        hidden, logits = self._run("mtp_draft", {
            "hidden_in": np.asarray(inp.hidden_in, np.float32), "token_ids": np.asarray(inp.token_ids, np.int64),
            "positions": np.asarray(inp.positions, np.int64), "counts": np.asarray(inp.counts, np.int32),
            "block_tables": np.asarray(inp.block_tables, np.int32),
        })  # fmt: skip
        return DraftOutput(hidden, logits)

    def run_commit(self, inp: CommitInput) -> int:
        (written,) = self._run("mtp_commit", {
            "hidden_in": np.asarray(inp.hidden_in, np.float32), "token_ids": np.asarray(inp.token_ids, np.int64),
            "counts": np.asarray(inp.counts, np.int32), "starts": np.asarray(inp.starts, np.int32),
            "block_tables": np.asarray(inp.block_tables, np.int32),
        })  # fmt: skip
        return int(written[0])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        with torch.no_grad():
            for src, dst in pairs:
                self.pool[:, :, dst] = self.pool[:, :, src]

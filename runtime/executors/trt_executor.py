"""The `tensorrt` executor: runs a tensorrt-backend engine directory's plans on one GPU (TensorRT 10.x/11.x).

NOT EXECUTED ANYWHERE YET: development machines have neither TensorRT nor a GPU. This module follows the
documented TensorRT Python API (engine deserialization, execution contexts, optimization profiles, `execute_async_v3`), is type-checked with
mypy against tensorrt-stubs, and fails fast with a clear message when TensorRT or CUDA is missing.

Owns, for one rank: the deserialized engines (one plan per graph), one execution context per graph, the KV
pool (allocated here on the GPU and kept alive; its address goes into the `kv_pool_ptr` input), and
stable-address torch CUDA buffers for every graph input/output, sized for the largest profile. Per call:
copy the step's arrays into the fixed buffers, pick the profile whose range holds the step's size,
`set_input_shape` + `set_tensor_address`, then `execute_async_v3` on a private stream. After one warm
run of a given (graph, profile, shapes) it captures a CUDA graph (thread-local capture mode) and replays it
from then on; a refused capture falls back to plain enqueue for that key (a refused enqueue inside capture
would otherwise record an empty graph, so the return value is checked).

The pool geometry (num_blocks included) is baked into the plans' plugin fields, so the pool has exactly
the engine's `kv.num_blocks`. Feeds come from the graph I/O spec (models.engine_format.graph_io).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from models.engine_format import EngineConfig, EngineDirError, load_engine_config
from models.engine_format.graph_io import POOL_INPUT, SPECS, feeds
from plugins.kv_pool import allocate_pool
from runtime.executors.base import CommitInput, DraftInput, DraftOutput, MainInput, MainOutput

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


def tensorrt_runtime_missing() -> str | None:
    from plugins.trt_plugins import tensorrt_missing

    return tensorrt_missing()


def _dims(d: trt.Dims) -> tuple[int, ...]:
    """Dims -> tuple (Dims supports len/indexing, not iteration, in the typed API)."""
    return tuple(d[i] for i in range(len(d)))


class _Graph:
    """One plan: engine, context, fixed buffers, profile ranges and captured CUDA graphs."""

    def __init__(self, runtime: trt.Runtime, plan: Path, stream: torch.cuda.Stream) -> None:
        import tensorrt as trt

        engine: trt.ICudaEngine | None = runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise EngineDirError(f"TensorRT could not deserialize {plan} (built by another TensorRT version or GPU?)")
        self.engine = engine
        self.context: trt.IExecutionContext = engine.create_execution_context()
        self.stream = stream
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.names if n not in self.inputs]
        self.num_profiles = int(self.engine.num_optimization_profiles)
        self.profile = 0
        self.buffers: dict[str, torch.Tensor] = {}
        last = self.num_profiles - 1
        for name in self.inputs:
            max_shape = _dims(self.engine.get_tensor_profile_shape(name, last)[2])
            self.buffers[name] = torch.empty(max_shape, dtype=self._dtype(name), device="cuda")
        self.warm: set[tuple[Any, ...]] = set()
        self.captured: dict[tuple[Any, ...], torch.cuda.CUDAGraph] = {}
        self.uncapturable: set[tuple[Any, ...]] = set()

    def _dtype(self, name: str) -> torch.dtype:
        import tensorrt as trt

        dt = self.engine.get_tensor_dtype(name)
        table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
                 trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64}  # fmt: skip
        return table[dt]

    def _pick_profile(self, arrays: dict[str, np.ndarray]) -> int:
        for p in range(self.num_profiles):
            if all(
                all(lo <= s <= hi for lo, s, hi in zip(_dims(prof[0]), arr.shape, _dims(prof[2]), strict=True))
                for name, arr in arrays.items()
                for prof in [self.engine.get_tensor_profile_shape(name, p)]
            ):
                return p
        shapes = {n: a.shape for n, a in arrays.items()}
        raise ValueError(f"step shapes {shapes} are outside every optimization profile of this engine (build limits)")

    def run(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        ctx, handle = self.context, self.stream.cuda_stream
        profile = self._pick_profile(arrays)
        if profile != self.profile:
            ctx.set_optimization_profile_async(profile, handle)
            self.profile = profile
        with torch.cuda.stream(self.stream):
            for name, arr in arrays.items():
                buf = self.buffers[name]
                view = buf.view(-1)[: arr.size].view(arr.shape)
                view.copy_(torch.from_numpy(np.ascontiguousarray(arr)).to(buf.dtype), non_blocking=False)
                if not ctx.set_input_shape(name, arr.shape):
                    raise ValueError(f"TensorRT refused shape {arr.shape} for input {name}")
                ctx.set_tensor_address(name, buf.data_ptr())
            outputs: dict[str, torch.Tensor] = {}
            for name in self.outputs:
                shape = _dims(ctx.get_tensor_shape(name))
                out = self.buffers.get(name)
                if out is None or out.numel() < int(np.prod(shape)):
                    # First use of this size: allocate once at this shape (outputs keep stable addresses after).
                    out = torch.empty(shape, dtype=self._dtype(name), device="cuda")
                    self.buffers[name] = out
                outputs[name] = out.view(-1)[: int(np.prod(shape))].view(shape)
                ctx.set_tensor_address(name, out.data_ptr())
            key = (profile, *[(n, a.shape) for n, a in arrays.items()])
            self._launch(key)
        self.stream.synchronize()
        return outputs

    def _launch(self, key: tuple[Any, ...]) -> None:
        graph = self.captured.get(key)
        if graph is not None:
            graph.replay()
            return
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        if key in self.warm and key not in self.uncapturable:
            self._capture(key)
        self.warm.add(key)

    def _capture(self, key: tuple[Any, ...]) -> None:
        """Capture after a warm run (never the first, which may initialize); fall back on any refusal."""
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                ok = self.context.execute_async_v3(self.stream.cuda_stream)
            if not ok:
                raise RuntimeError("execute_async_v3 refused under capture")
        except RuntimeError as e:
            log.warning("CUDA graph capture failed for %s (%s); using plain enqueue", key, e)
            self.uncapturable.add(key)
            return
        self.captured[key] = graph


class TrtExecutor:
    def __init__(self, engine_dir: str | Path, rank: int = 0, num_blocks: int | None = None) -> None:
        missing = tensorrt_runtime_missing()
        if missing:
            raise RuntimeError(f"the tensorrt executor cannot run here: {missing}; use the onnxruntime executor on CPU")
        import tensorrt as trt

        from plugins.trt_plugins import register_plugins

        self.config: EngineConfig = load_engine_config(engine_dir)
        cfg, kv = self.config, self.config.kv
        if cfg.backend != "tensorrt":
            raise EngineDirError(f"{cfg.path} was built for {cfg.backend}; rebuild with --backend tensorrt")
        if not 0 <= rank < cfg.world_size:
            raise EngineDirError(f"rank {rank} is outside the engine's world_size={cfg.world_size}")
        if num_blocks is not None and num_blocks != kv.num_blocks:
            raise ValueError(f"TensorRT plans fix the pool at {kv.num_blocks} blocks; rebuild to change it")
        register_plugins()  # creators must be registered before a plan holding plugin layers is deserialized
        self.logger = trt.Logger(trt.Logger.WARNING)  # must outlive the runtime
        self.runtime = trt.Runtime(self.logger)
        self.geom = kv.geometry()
        self.pool = allocate_pool(self.geom, "cuda")
        self.hidden_size, self.vocab_size = cfg.model.hidden_size, cfg.model.vocab_size
        self.stream = torch.cuda.Stream()  # never the legacy default stream (it serializes, and breaks capture)
        self.graphs: dict[str, _Graph] = {}
        for name in cfg.graphs[rank]:
            plan = cfg.graph_file(rank, name, "plan")
            if plan is None:
                raise EngineDirError(
                    f"{cfg.path} has no plan for {name} on rank {rank}; rebuild with --backend tensorrt"
                )
            self.graphs[name] = _Graph(self.runtime, plan, self.stream)
        self._ptr = np.array([self.pool.data_ptr()], dtype=np.int64)

    def _run(self, graph: str, inp: object) -> dict[str, torch.Tensor]:
        return self.graphs[graph].run({**feeds(SPECS[graph], inp), POOL_INPUT: self._ptr})

    def run_main(self, inp: MainInput) -> MainOutput:
        out = self._run("main", inp)
        return MainOutput(**{n: out[n].float().cpu().numpy() for n in SPECS["main"].outputs})

    def run_draft(self, inp: DraftInput) -> DraftOutput:
        out = self._run("mtp_draft", inp)
        return DraftOutput(**{n: out[n].float().cpu().numpy() for n in SPECS["mtp_draft"].outputs})

    def run_commit(self, inp: CommitInput) -> int:
        return int(self._run("mtp_commit", inp)["rows_written"][0].item())

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for src, dst in pairs:
                self.pool[:, :, dst] = self.pool[:, :, src]
        self.stream.synchronize()

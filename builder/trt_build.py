"""The tensorrt backend: ONNX graphs -> one serialized plan per graph per rank (TensorRT 10.x / 11.x API).

Owns: the availability check (TensorRT library + CUDA GPU + plugin registration module), optimization
profiles derived from the build limits, the persisted timing cache, and plan files. It cannot run on the
development machines (no TensorRT, no GPU): it is type-checked with mypy against tensorrt-stubs and stops
at once, naming what is missing, when asked to build there.

Profiles (one per bucket; the runtime picks the bucket whose range holds the step's size):
  main        token-count buckets: decode/verify steps (<= max_batch*(1+K) rows), then prefill up to max_num_tokens
  mtp_draft   request-count buckets: powers of two up to max_batch
  mtp_commit  row buckets: decode commits (<= max_batch*K rows), then prefill chunks up to max_num_tokens
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.options import BuildError
from models.engine_format.config import Limits
from models.engine_format.graph_io import SPECS
from models.engine_format.layout import KVLayout

if TYPE_CHECKING:
    import tensorrt as trt

TIMING_CACHE = "timing.cache"
WORKSPACE_BYTES = 4 << 30


def tensorrt_missing() -> str | None:
    """Why a TensorRT build cannot run here, or None when it can."""
    from plugins.trt_plugins import tensorrt_missing as missing

    return missing()


def _ranges(first: int, last: int) -> list[tuple[int, int, int]]:
    """(min, opt, max) buckets: [1, first] then (first, last] when last > first."""
    first = min(first, last)
    out = [(1, first, first)]
    if last > first:
        out.append((first + 1, last, last))
    return out


def _pow2_ranges(last: int) -> list[tuple[int, int, int]]:
    out, lo, hi = [], 1, 1
    while lo <= last:
        hi = min(max(hi, lo), last)
        out.append((lo, hi, hi))
        lo, hi = hi + 1, hi * 2
    return out


Profiles = list[dict[str, tuple[int, int, int]]]


def profile_dims(graph: str, limits: Limits, kv: KVLayout, num_draft_tokens: int) -> Profiles:
    """Per profile: symbolic dim name -> (min, opt, max), from the limits and layout recorded in config.json.

    The block-table axis spans the layout's table width (lookahead included), the width the runtime sends.
    """
    k, mb, mt = num_draft_tokens, limits.max_batch, limits.max_num_tokens
    reqs, blocks = (1, mb, mb), (1, kv.table_width, kv.table_width)
    if graph == "main":
        # logit_rows starts at 0: a step of partial prefill chunks only needs no logits at all (an empty tensor).
        return [{"tokens": t, "requests": reqs, "max_blocks": blocks, "logit_rows": (0, t[1], t[2])}
                for t in _ranges(mb * (1 + k), mt)]  # fmt: skip
    if graph == "mtp_draft":
        return [{"requests": r, "max_blocks": blocks} for r in _pow2_ranges(mb)]
    if graph == "mtp_commit":
        return [{"rows": n, "requests": reqs, "max_blocks": blocks} for n in _ranges(max(mb * k, 1), mt)]
    raise KeyError(graph)


def _parse(builder: trt.Builder, logger: trt.ILogger, onnx_path: Path) -> trt.INetworkDefinition:
    import tensorrt as trt

    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)  # enum name: bit values moved in 11.0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    override = getattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE", None)  # TensorRT >= 10.15, not in 10.13 stubs
    if override is not None:
        parser.set_flag(override)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    return network


def build_plan(graph: str, onnx_path: Path, plan_path: Path, cache_path: Path, profiles: Profiles) -> dict[str, Any]:
    """Parse `onnx_path`, build a strongly typed plan with one profile per bucket (`profile_dims`), persist the
    timing cache."""
    import tensorrt as trt

    from plugins.trt_plugins import register_plugins

    register_plugins()  # creators must be in the registry before the parser meets a plugin node
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = _parse(builder, logger, onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, False)  # never ignore a mismatch: tactics from another GPU are wrong here
    dynamic = SPECS[graph].dynamic
    for dims in profiles:
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            shape = [tensor.shape[d] for d in range(len(tensor.shape))]
            lo, opt, hi = list(shape), list(shape), list(shape)
            for axis, sym in dynamic[tensor.name].items():
                lo[axis], opt[axis], hi[axis] = dims[sym]
            profile.set_shape(tensor.name, trt.Dims(lo), trt.Dims(opt), trt.Dims(hi))
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"TensorRT failed to build {graph} from {onnx_path.name} (see the TensorRT log above)")
    plan_path.write_bytes(bytes(serialized))
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return {"plan": plan_path.name, "profiles": [{k: list(v) for k, v in d.items()} for d in profiles],
            "tensorrt_version": str(getattr(trt, "__version__", "unknown"))}  # fmt: skip

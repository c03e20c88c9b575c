"""runtime/: loads an engine (or a checkpoint) and serves requests. The public Python API is this package's names:

    from runtime import LLM, SamplingParams, build_engine
    outputs = LLM("engines/deep").generate(["def main("], SamplingParams(max_tokens=32))

`__all__` below is that API (runtime/api.py defines it; tests/test_public_api.py pins it): import it from here,
not from the modules that implement it, which refactors may move. The names load on first use, so
`import runtime` (every CLI does) stays cheap and loads neither torch nor the engine.

Rooms, lowest first:

* `core/`       the engine: requests, admission, scheduling, paged KV with prefix caching, the MTP step as
                plan-then-apply, sampling, the adaptive draft length, metrics. Torch-free: it plans on ints
                and numpy arrays and talks to an executor through runtime/executors/base.py.
* `executors/`  torch, onnxruntime, tensorrt: run the three graphs over a KV pool they own.
* `multirank/`  mpirun jobs: the rank strategies the engine is constructed with (single rank, DP lockstep,
                TP leader / follower), the start-up fingerprint, the collective watchdog.
* `factory.py`  `create_engine`: the one place that assembles executor + strategy + engine.
* applications, which nothing above imports and which alone may import the builder: `api.py` (the Python API:
  `LLM`, `build_engine`), `cli.py` (`mtp-run`), `serving/` (`mtp-serve`), `bench/` (`mtp-bench`), `demo.py`,
  `gpu_check.py`.
"""

import os
import typing

# OpenMP workers that spin-wait made every step 10-100x slower with 2+ torch threads on a shared machine;
# passive waiting cost nothing measurable (docs/PERFORMANCE.md). libgomp reads this when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "ConfigError", "GenerationOutput", "RequestError", "SamplingParams", "TokenLogprob", "build_engine",
           "create_engine"]  # fmt: skip

if typing.TYPE_CHECKING:
    from runtime.api import (
        LLM,
        ConfigError,
        GenerationOutput,
        RequestError,
        SamplingParams,
        TokenLogprob,
        build_engine,
        create_engine,
    )


def __getattr__(name: str) -> typing.Any:
    """The public names, imported from runtime/api.py on first access (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    from runtime import api

    value = getattr(api, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

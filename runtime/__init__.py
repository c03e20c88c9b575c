"""runtime/: loads an engine (or a checkpoint) and serves requests. Rooms, lowest first:

* `core/`       the engine: requests, admission, scheduling, paged KV with prefix caching, the MTP step as
                plan-then-apply, sampling, the adaptive draft length, metrics. Torch-free: it plans on ints
                and numpy arrays and talks to an executor through runtime/executors/base.py.
* `executors/`  torch, onnxruntime, tensorrt: run the three graphs over a KV pool they own.
* `multirank/`  mpirun jobs: the rank strategies the engine is constructed with (single rank, DP lockstep,
                TP leader / follower), the start-up fingerprint, the collective watchdog.
* `factory.py`  `create_engine`: the one place that assembles executor + strategy + engine.
* applications, which nothing above imports and which alone may import the builder: `cli.py` (`mtp-run`),
  `serving/` (`mtp-serve`), `bench/` (`mtp-bench`), `demo.py`, `gpu_check.py`.
"""

import os

# OpenMP workers that spin-wait made every step 10-100x slower with 2+ torch threads on a shared machine;
# passive waiting cost nothing measurable (docs/PERFORMANCE.md). libgomp reads this when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

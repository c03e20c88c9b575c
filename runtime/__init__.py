"""runtime/: loads an engine (or a checkpoint) and serves requests.

Owns: per-request state (request.py), admission checks (admission.py), continuous batching (scheduler.py),
paged KV blocks with prefix caching (block_pool.py, kv_manager.py), the exact MTP step as plan-then-apply
(mtp_plan.py plans, engine.py applies), sampling and acceptance (sampling.py), the adaptive draft length
(draft_length.py), metrics, multi-rank lockstep and the start-up fingerprint (parallel.py, fingerprint.py),
the tensor-parallel leader/follower split (tp_group.py) and the collective watchdog (watchdog.py),
executors (executors/: torch, onnxruntime, tensorrt), `mtp-run` (cli.py) and `create_engine` (factory.py).
Apps on top, which the engine never imports: bench/ (`mtp-bench`), serving/ (`mtp-serve`), demo.py.
The control plane (everything but executors/) is torch-free and never imports the builder (tp_group.join
imports plugins.collectives, which needs torch, only in a multi-rank job).
"""

import os

# OpenMP workers that spin-wait made every step 10-100x slower with 2+ torch threads on a shared machine;
# passive waiting cost nothing measurable (docs/PERFORMANCE.md). libgomp reads this when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

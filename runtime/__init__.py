"""runtime/: loads an engine (or a checkpoint) and serves requests.

Owns: continuous batching (scheduler.py), paged KV blocks with prefix caching (block_pool.py,
kv_manager.py), the exact MTP speculative step (mtp_plan.py, engine.py), sampling and acceptance
(sampling.py), metrics, executors (executors/: torch, onnxruntime, tensorrt), the CLIs.
The control plane (everything but executors/) is torch-free.
"""

import os

# OpenMP workers that spin-wait made every step 10-100x slower with 2+ torch threads on a shared machine;
# passive waiting cost nothing measurable (docs/PERFORMANCE.md). libgomp reads this when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

"""runtime/: loads an engine (or a checkpoint) and serves requests.

Owns: continuous batching (scheduler.py), paged KV blocks with prefix caching (block_pool.py,
kv_manager.py), the exact MTP speculative step (mtp_plan.py, engine.py), sampling and acceptance
(sampling.py), metrics, executors (executors/: torch, onnxruntime, tensorrt), the CLIs.
The control plane (everything but executors/) is torch-free.
"""

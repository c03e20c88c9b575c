"""runtime/core/: the engine, torch-free (tests/test_floors.py pins it).

Owns per-request state (request.py), admission checks (admission.py), continuous batching (scheduler.py),
paged KV blocks with prefix caching (block_pool.py, kv_manager.py), the exact MTP step as plan-then-apply
(mtp_plan.py plans, engine.py applies), sampling and acceptance (sampling.py), the adaptive draft length
(draft_length.py), the runtime config (config.py) and metrics (metrics.py).
"""

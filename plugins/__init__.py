"""plugins/: the custom operators the engine graphs need (varlen paged KV write, paged attention, MoE
experts). One semantic definition each (reference.py) and its implementations: torch ops (ops.py),
Triton kernels, ONNX Runtime custom ops, TensorRT plugins, and the ONNX export rules; the expert-parallel
exchange (moe_ep.py) and the tensor-parallel collectives (collectives.py, trt_collectives.py). Also the engine
format (engine_format/): the on-disk contract between the builder and the runtime, which both import."""

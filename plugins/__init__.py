"""plugins/: the custom operators the engine graphs need (varlen paged KV write, paged attention, MoE
experts; the MLA latent-pool write and absorbed attention). One semantic definition each (reference.py) and
its implementations: torch ops (ops.py, mla_ops.py), Triton kernels (triton_kernels.py, mla_triton.py),
ONNX Runtime custom ops, TensorRT plugins, and the ONNX export rules. Also the engine format
(engine_format/): the on-disk contract between the builder and the runtime, which both import."""

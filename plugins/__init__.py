"""plugins/: the custom operators the engine graphs need (varlen paged KV write, paged attention, MoE
experts; the MLA latent-pool write and absorbed attention; the bf16-weight linear; the Gated DeltaNet step over
its state pool). One semantic definition each (reference.py) and
its implementations: C++ CPU kernels registered with the torch dispatcher (csrc/, loaded by cpp_ops.py; they
define the ops' torch schemas), the Python side of the torch ops (ops.py, mla_ops.py, gdn_ops.py: fakes, CUDA ->
Triton kernels in triton_kernels.py, mla_triton.py, gdn_triton.py), ONNX Runtime custom ops, TensorRT plugins, and the ONNX export
rules, all derived from one spec per op (op_spec.py, op_backends.py); the expert-parallel exchange (moe_ep.py)
and the tensor-parallel collectives (collectives.py, trt_collectives.py)."""

"""runtime/executors/: the backends behind the three-call executor contract (base.py).

* `torch_executor`  the PyTorch model directly (CPU reference; on CUDA, CUDA graphs per request bucket
                    via `cuda_graphs`, not yet executed on a GPU)
* `compiled_executor` an engine directory's AOTInductor packages (`mtp-build --compile aoti`), stable input
                    buffers per graph: the fastest CPU executor and `auto`'s choice when the engine has them
* `ort_executor`    an engine directory's ONNX graphs in ONNX Runtime (`auto`'s choice without packages)
* `trt_executor`    an engine directory's TensorRT plans (needs TensorRT + a GPU; not executed here)

Executors own the KV pool memory and the model/engine; they never own blocks, scheduling or sampling.
"""

"""TensorRT plugin registration for the plugin nodes (namespace `mtp`, version "1").

Importing this module never needs TensorRT; `register_plugins()` does, and raises a clear RuntimeError
where TensorRT (>= 10.x, with a CUDA GPU) is missing. The plugin classes live in plugins/_trt_impl.py,
which imports TensorRT at the top and is loaded only from here. `tensorrt-stubs` alone makes
`import tensorrt` succeed as an empty namespace package, so presence is tested by a real API symbol.

Call `register_plugins()` before parsing an ONNX graph holding plugin nodes and before deserializing an
engine built from one. MoeExperts has no TensorRT plugin yet (its ep_size > 1 form needs NCCL).
"""

from __future__ import annotations

from typing import Any

from plugins.names import DOMAIN, TRT_PLUGIN_NODES

NAMESPACE = DOMAIN
PLUGIN_NAMES = TRT_PLUGIN_NODES
_NOT_INSTALLED = (
    "TensorRT is not installed (or only its type stubs are): build TensorRT engines on a machine with "
    "TensorRT >= 10.x and a CUDA GPU"
)
_registered: list[Any] = []  # creators must outlive registration: TensorRT keeps only a reference


def tensorrt_available() -> bool:
    """True when a real TensorRT (not just tensorrt-stubs) is importable."""
    try:
        import tensorrt
    except ImportError:
        return False
    return hasattr(tensorrt, "Builder") and hasattr(tensorrt, "IPluginV3")


def tensorrt_missing() -> str | None:
    """Why TensorRT engines cannot be built or run here, or None when they can (the one place that checks)."""
    try:
        import tensorrt
    except ImportError:
        return "TensorRT is not installed (pip install tensorrt on a machine with an NVIDIA GPU and CUDA)"
    if not tensorrt_available():
        # `tensorrt-stubs` installs an importable but empty `tensorrt` package (type stubs only).
        return f"only the TensorRT type stubs are installed, not the TensorRT library {tensorrt.__name__} 10.x/11.x"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to this process (TensorRT plans are built for and run on a GPU)"
    return None


def require_tensorrt() -> None:
    if not tensorrt_available():
        raise RuntimeError(_NOT_INSTALLED)


def register_plugins() -> list[str]:
    """Register the creators into `trt.get_plugin_registry()` under namespace "mtp" (idempotent).

    Returns the registered plugin names.
    """
    require_tensorrt()
    if _registered:
        return list(PLUGIN_NAMES)
    import tensorrt as trt

    from plugins import _trt_impl

    registry = trt.get_plugin_registry()
    for creator in _trt_impl.creators():
        if not registry.register_creator(creator, NAMESPACE):
            raise RuntimeError(f"TensorRT refused to register plugin creator {creator.name} in {NAMESPACE!r}")
        _registered.append(creator)
    return list(PLUGIN_NAMES)

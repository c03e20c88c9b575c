"""What can be checked here of the TensorRT plugins and the GPU check (no TensorRT, no CUDA on CI machines)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.engine_format import names
from plugins import trt_plugins

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(trt_plugins.tensorrt_available(), reason="real TensorRT present")
def test_register_plugins_without_tensorrt_raises_clearly() -> None:
    with pytest.raises(RuntimeError, match="TensorRT is not installed.*TensorRT >= 10"):
        trt_plugins.register_plugins()


@pytest.mark.skipif(not trt_plugins.tensorrt_available(), reason="needs TensorRT")
def test_register_plugins_with_tensorrt() -> None:
    import tensorrt as trt

    assert trt_plugins.register_plugins() == ["KvWrite", "PagedAttention", "MlaKvWrite", "MlaPagedAttention"]
    for name in trt_plugins.PLUGIN_NAMES:
        assert trt.get_plugin_registry().get_creator(name, "1", "mtp") is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the real check runs via `make gpu-check`")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    done = subprocess.run([sys.executable, "-m", "plugins.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"skipped": "no CUDA device: skipping GPU check"}


def test_every_trt_plugin_node_has_a_plugin_class_with_its_attribute_spec() -> None:
    """Without TensorRT: read plugins/_trt_impl.py's classes (name = NODE, spec = NODE_ATTRS) and its creators()."""
    tree = ast.parse((ROOT / "plugins" / "_trt_impl.py").read_text())
    plugins: dict[str, tuple[str, str]] = {}  # class -> (node constant, spec constant)
    creators: dict[str, str] = {}  # creator class -> plugin class
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        assigned = {t.id: v.id for a in cls.body if isinstance(a, ast.Assign) and isinstance(v := a.value, ast.Name)
                    for t in a.targets if isinstance(t, ast.Name)}  # fmt: skip
        if "name" in assigned and "spec" in assigned:
            plugins[cls.name] = (assigned["name"], assigned["spec"])
        if "plugin_cls" in assigned:
            creators[cls.name] = assigned["plugin_cls"]
    nodes = {getattr(names, node): spec for node, spec in plugins.values()}
    assert sorted(nodes) == sorted(names.TRT_PLUGIN_NODES)
    assert nodes["MlaKvWrite"] == "MLA_KV_WRITE_ATTRS" and nodes["MlaPagedAttention"] == "MLA_PAGED_ATTENTION_ATTRS"
    listed = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "creators")
    called = [c.func.id for c in ast.walk(listed) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    assert [plugins[creators[c]][0] for c in called] == ["KV_WRITE", "PAGED_ATTENTION", "MLA_KV_WRITE",
                                                         "MLA_PAGED_ATTENTION"]  # fmt: skip


@pytest.mark.parametrize("op, spec", [("kv_write", "KV_WRITE_ATTRS"), ("paged_attention", "PAGED_ATTENTION_ATTRS"),
                                      ("mla_kv_write", "MLA_KV_WRITE_ATTRS"),
                                      ("mla_paged_attention", "MLA_PAGED_ATTENTION_ATTRS")])  # fmt: skip
def test_node_attributes_are_the_torch_ops_non_tensor_arguments(op: str, spec: str) -> None:
    """The ORT ops and the TensorRT plugins read fields by these specs: their names and order are the op's."""
    import plugins.mla_ops  # noqa: F401
    import plugins.ops  # noqa: F401
    from plugins import onnx_export

    args = getattr(torch.ops.mtp, op).default._schema.arguments
    non_tensor = [a.name for a in args if not str(a.type).startswith("Tensor")]
    assert [name for name, _, _ in getattr(onnx_export, spec)] == non_tensor

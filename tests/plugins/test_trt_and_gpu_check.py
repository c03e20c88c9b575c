"""What can be checked here of the TensorRT plugins and the GPU check (no TensorRT, no CUDA on CI machines)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugins import names, trt_plugins

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(trt_plugins.tensorrt_available(), reason="real TensorRT present")
def test_register_plugins_without_tensorrt_raises_clearly() -> None:
    with pytest.raises(RuntimeError, match="TensorRT is not installed.*TensorRT >= 10"):
        trt_plugins.register_plugins()


@pytest.mark.skipif(not trt_plugins.tensorrt_available(), reason="needs TensorRT")
def test_register_plugins_with_tensorrt() -> None:
    import tensorrt as trt

    assert trt_plugins.register_plugins() == ["KvWrite", "PagedAttention", "MlaKvWrite", "MlaPagedAttention", "GdnStep",
                                              "SwaPagedAttention", "DsaIndexTopk", "DsaSparseAttention"]  # fmt: skip
    for name in trt_plugins.PLUGIN_NAMES:
        assert trt.get_plugin_registry().get_creator(name, "1", "mtp") is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the real check runs via `make gpu-check`")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    done = subprocess.run([sys.executable, "-m", "plugins.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"skipped": "no CUDA device: skipping GPU check"}


def test_every_trt_plugin_node_has_a_plugin_class_with_its_op_spec() -> None:
    """Without TensorRT: read plugins/_trt_impl.py's classes (name = NODE, spec = SPECS["op"]) and its creators()."""
    from plugins.op_spec import SPECS

    tree = ast.parse((ROOT / "plugins" / "_trt_impl.py").read_text())
    plugins: dict[str, tuple[str, str]] = {}  # class -> (node constant, spec op)
    creators: dict[str, str] = {}  # creator class -> plugin class
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        assigned = {t.id: a.value for a in cls.body if isinstance(a, ast.Assign) for t in a.targets
                    if isinstance(t, ast.Name)}  # fmt: skip
        if isinstance(assigned.get("name"), ast.Name) and isinstance(assigned.get("spec"), ast.Subscript):
            plugins[cls.name] = (assigned["name"].id, ast.literal_eval(assigned["spec"].slice))
        if isinstance(assigned.get("plugin_cls"), ast.Name):
            creators[cls.name] = assigned["plugin_cls"].id
    nodes = {getattr(names, node): op for node, op in plugins.values()}
    assert sorted(nodes) == sorted(names.TRT_PLUGIN_NODES) == sorted(s.node for s in SPECS.values() if s.tensorrt)
    assert all(SPECS[op].node == node for node, op in nodes.items())
    listed = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "creators")
    called = [c.func.id for c in ast.walk(listed) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    assert [plugins[creators[c]][0] for c in called] == ["KV_WRITE", "PAGED_ATTENTION", "MLA_KV_WRITE",
                                                         "MLA_PAGED_ATTENTION", "GDN_STEP", "SWA_PAGED_ATTENTION",
                                                         "DSA_INDEX_TOPK", "DSA_SPARSE_ATTENTION"]  # fmt: skip


def test_node_attributes_are_the_torch_ops_non_tensor_arguments() -> None:
    """The ORT ops and the TensorRT plugins read fields by the specs: their names and order are the torch op's."""
    import plugins.collectives  # noqa: F401
    import plugins.gdn_ops  # noqa: F401
    import plugins.mla_ops  # noqa: F401
    import plugins.ops  # noqa: F401
    from plugins.op_spec import SPECS

    for spec in SPECS.values():
        args = getattr(torch.ops.mtp, spec.op).default._schema.arguments
        tensor = [str(a.type).removeprefix("Optional[").startswith("Tensor") for a in args]  # Tensor? is Optional
        assert [a.name for a, t in zip(args, tensor, strict=True) if t] == [t.name for t in spec.inputs]
        assert [a.name for a, t in zip(args, tensor, strict=True) if not t] == [a.name for a in spec.attrs]

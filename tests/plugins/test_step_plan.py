"""The CPU fast path's per-forward plans (plugins/step_plan.py) and the MoE strategies (plugins/ops.py).

Plans are looked up by metadata content: computed once per forward however many layers ask, and never
reused after the metadata changes in place (captured-execution buffers are rewritten between forwards).
Every MoE strategy (gathered / dense / loop) equals moe_experts_ref, whichever the cost model would pick;
the per-forward RoPE table equals apply_rope exactly.
"""

from __future__ import annotations

import pytest
import torch

import plugins.ops as ops
import plugins.step_plan as step_plan
from models.layers import PagedKV, StepMeta
from models.testing import random_model, tiny_config
from plugins.kv_pool import KVPoolGeometry, allocate_pool, pool_address
from plugins.reference import kv_write_ref, moe_experts_ref
from plugins.rope import apply_rope, rope_table


def _write(pool, geom, k, v, counts, starts, tables, plane=0):
    return torch.ops.mtp.kv_write(k, v, counts, starts, tables, pool_address(pool), plane, *geom.attrs().values(),
                                  0, 10000.0)  # fmt: skip


def test_plan_follows_metadata_rewritten_in_place() -> None:
    """Same tensor objects, new content: the second write must land in the new block (a stale plan would not)."""
    geom = KVPoolGeometry(1, 4, 2, 1, 4)
    pool = allocate_pool(geom)
    k = torch.randn(1, 1, 4)
    counts, starts = torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    tables = torch.tensor([[1]], dtype=torch.int32)
    _write(pool, geom, k, k, counts, starts, tables)
    tables[0, 0] = 3  # rewritten in place, as the static buffers of captured execution are
    _write(pool, geom, 2 * k, 2 * k, counts, starts, tables)
    expected = allocate_pool(geom)
    kv_write_ref(expected, k, k, counts, starts, torch.tensor([[1]], dtype=torch.int32), 0)
    kv_write_ref(expected, 2 * k, 2 * k, counts, starts, tables, 0)
    assert torch.equal(pool, expected)


def test_plans_are_computed_once_per_forward(monkeypatch) -> None:
    cfg = tiny_config(num_hidden_layers=4)
    model = random_model(cfg).fuse()
    geom = KVPoolGeometry(model.num_kv_planes, 8, 4, cfg.num_key_value_heads, cfg.head_dim)
    pool = allocate_pool(geom)
    calls = {"write": 0, "attend": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(ops, "plan_write", counting("write", step_plan.plan_write))
    monkeypatch.setattr(ops, "plan_attention", counting("attend", step_plan.plan_attention))
    step_plan._CACHE.clear()
    n = 5
    meta = StepMeta(torch.arange(n), torch.tensor([n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                    torch.tensor([[1, 2]], dtype=torch.int32))  # fmt: skip
    with torch.inference_mode():
        model.forward_main(torch.arange(n), meta, PagedKV(pool_address(pool), geom))
    assert calls == {"write": 1, "attend": 1}, f"{cfg.num_hidden_layers} layers planned {calls} times"


@pytest.mark.parametrize("strategy", ["gathered", "dense", "loop"])
@pytest.mark.parametrize("tokens,offset", [(1, 0), (3, 0), (9, 0), (4, 2), (0, 0)])
def test_moe_strategies_match_reference(monkeypatch, strategy: str, tokens: int, offset: int) -> None:
    """offset 2: the local slice holds global experts 2..5 of 8; the others' pairs contribute nothing."""
    gen = torch.Generator().manual_seed(tokens + 10 * offset)
    hidden, inter, num_local, top_k = 8, 4, 4, 2
    x = torch.randn(tokens, hidden, generator=gen)
    picks = [torch.randperm(8 if offset else num_local, generator=gen)[:top_k] for _ in range(tokens)]
    ids = torch.stack(picks) if picks else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(tokens, top_k, generator=gen)
    w_gate_up = torch.randn(num_local, 2 * inter, hidden, generator=gen)
    w_down = torch.randn(num_local, hidden, inter, generator=gen)
    monkeypatch.setattr(ops, "choose_experts_strategy", lambda *a: strategy)
    out = ops.moe_experts_local(x, ids, weights, w_gate_up, w_down, offset)
    ref = moe_experts_ref(x, ids, weights, w_gate_up, w_down, offset)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_cost_model_picks_each_strategy() -> None:
    """models/tiny's width (H 256, I 64, 8 experts, top-2): decode gathers, a 16-row verify goes dense,
    prefill loops; experts too big to copy are never gathered."""
    expert = 3 * 64 * 256 * 4
    assert ops.choose_experts_strategy(2, 0, 8, 2, 64, 256, expert) == "gathered"
    assert ops.choose_experts_strategy(32, 8, 8, 2, 64, 256, expert) == "dense"
    assert ops.choose_experts_strategy(256, 8, 8, 2, 64, 256, expert) == "loop"
    assert ops.choose_experts_strategy(8, 8, 160, 8, 1536, 5120, 3 * 1536 * 5120 * 2) == "loop"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope_dim", [4, 16, 32])
def test_rope_table_equals_apply_rope_bit_for_bit(dtype: torch.dtype, rope_dim: int) -> None:
    """The per-forward table (what every layer uses) vs the reference rotation, partial and full rotary."""
    gen = torch.Generator().manual_seed(rope_dim)
    x = torch.randn(9, 3, 32, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (9,), generator=gen)
    expected = apply_rope(x, positions, rope_dim, 10000.0)
    assert torch.equal(rope_table(positions, rope_dim, 32, 10000.0, dtype).apply(x), expected)


def test_ort_nodes_of_one_forward_share_a_plan(monkeypatch) -> None:
    """ONNX Runtime hands every Python-op node fresh copies of its inputs: two KvWrite nodes (two layers)
    over the same metadata still plan once, and both planes get the rows."""
    import onnx
    from onnx import TensorProto, helper

    from plugins.onnx_export import DOMAIN, PLUGIN_VERSION
    from plugins.ort_ops import make_session

    geom = KVPoolGeometry(2, 4, 2, 1, 4)
    calls = []
    monkeypatch.setattr(ops, "plan_write", lambda *a: calls.append(1) or step_plan.plan_write(*a))
    step_plan._CACHE.clear()
    names = ["k", "v", "counts", "starts", "tables", "pool_ptr"]
    types = [TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT32, TensorProto.INT32,
             TensorProto.INT64]  # fmt: skip
    nodes = [helper.make_node("KvWrite", names, [f"written{p}"], domain=DOMAIN, plane=p, **geom.attrs(), rope_dim=0,
                              rope_theta=10000.0, plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION)
             for p in range(2)]  # fmt: skip
    graph = helper.make_graph(nodes, "two_layers", [helper.make_tensor_value_info(n, t, None) for n, t in
                              zip(names, types, strict=True)],
                              [helper.make_tensor_value_info(f"written{p}", TensorProto.INT64, [1]) for p in range(2)])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    session = make_session(onnx.ModelProto.FromString(model.SerializeToString()))
    pool = allocate_pool(geom)
    k = torch.randn(3, 1, 4)
    feeds = {"k": k.numpy(), "v": k.numpy(), "counts": torch.tensor([3], dtype=torch.int32).numpy(),
             "starts": torch.tensor([1], dtype=torch.int32).numpy(),
             "tables": torch.tensor([[1, 2]], dtype=torch.int32).numpy(), "pool_ptr": pool_address(pool).numpy()}  # fmt: skip
    written = session.run(None, feeds)
    assert [int(w[0]) for w in written] == [3, 3]
    assert len(calls) == 1, f"two nodes planned {len(calls)} times"
    assert torch.equal(pool[0], pool[1]) and pool[0].abs().sum() > 0

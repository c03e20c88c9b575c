"""Every shape the runtime can send is admitted by the limits recorded in the engine.

For random engine limits (what `mtp-build` records: `Limits`, the `KVLayout` and K) and random runtime
configs that `create_engine` admits under them, a real engine runs requests to max_seq_len with k drafts
(the lookahead is largest there) and every executor call is checked against the engine's table width and
the TensorRT optimization profiles derived from those limits (tokens, requests, rows, block-table width).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from builder.trt_build import profile_dims
from models.engine_format import KVLayout, Limits
from models.engine_format.graph_io import GRAPH_NAMES, SPECS
from runtime.core.config import ConfigError, RuntimeConfig
from runtime.core.engine import LLMEngine
from runtime.core.sampling import SamplingParams
from runtime.executors.base import CommitInput, DraftInput, DraftOutput, Executor, MainInput, MainOutput
from runtime.executors.torch_executor import TorchExecutor
from runtime.factory import check_within_engine
from tests.runtime.engine_utils import cached_model, random_prompts


@dataclass
class ProfileCheckingExecutor:
    """Delegates to a real executor; first checks each call's dims fit one profile of its graph (as TensorRT's
    profile selection requires) and that block tables are no wider than the engine's table width."""

    inner: Executor
    profiles: dict[str, list[dict[str, tuple[int, int, int]]]]
    table_width: int
    seen: dict[str, set[tuple[tuple[str, int], ...]]] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return self.inner.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def _check(self, graph: str, inp: object) -> None:
        spec, sizes = SPECS[graph], {}
        for name in spec.step_inputs:
            shape = np.shape(getattr(inp, name))
            for axis, sym in spec.dynamic[name].items():
                assert sizes.setdefault(sym, shape[axis]) == shape[axis], f"{graph}: {sym} differs across inputs"
        assert sizes["max_blocks"] <= self.table_width, f"{graph}: table of {sizes['max_blocks']} blocks"
        fits = [all(lo <= sizes[d] <= hi for d, (lo, _, hi) in prof.items()) for prof in self.profiles[graph]]
        assert any(fits), f"{graph} step dims {sizes} fit no profile {self.profiles[graph]}"
        self.seen.setdefault(graph, set()).add(tuple(sorted(sizes.items())))

    def run_main(self, inp: MainInput) -> MainOutput:
        self._check("main", inp)
        return self.inner.run_main(inp)

    def run_draft(self, inp: DraftInput) -> DraftOutput:
        self._check("mtp_draft", inp)
        return self.inner.run_draft(inp)

    def run_commit(self, inp: CommitInput) -> int:
        self._check("mtp_commit", inp)
        return self.inner.run_commit(inp)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.inner.copy_blocks(pairs)


def _engine_limits(rng: random.Random) -> tuple[Limits, KVLayout, int]:
    """What mtp-build would record for random (valid) build options."""
    model_cfg, _ = cached_model()
    block = rng.choice([4, 8])
    k = rng.randint(0, 3)
    max_batch = rng.randint(1, 4)
    limits = Limits(max_batch, rng.randint(max_batch * (1 + k), 48), rng.randint(k + 2, 40))
    kv = KVLayout.plan(num_planes=model_cfg.num_hidden_layers + model_cfg.num_mtp_modules,
                       num_kv_heads=model_cfg.num_key_value_heads, head_dim=model_cfg.head_dim, dtype_code=0,
                       block_size=block, max_batch=max_batch, max_seq_len=limits.max_seq_len,
                       num_draft_tokens=k)  # fmt: skip
    return limits, kv, k


def _runtime_config(rng: random.Random, lim: Limits, kv: KVLayout, k: int) -> RuntimeConfig:
    """A random config `create_engine` admits for that engine (overrides stay within its limits)."""
    rk = rng.randint(0, k)
    batch = rng.randint(1, lim.max_batch)
    return RuntimeConfig(max_batch=batch, max_num_tokens=rng.randint(batch * (1 + rk), lim.max_num_tokens),
                         max_seq_len=rng.randint(rk + 2, lim.max_seq_len), block_size=kv.block_size,
                         num_blocks=kv.num_blocks, num_draft_tokens=rk,
                         max_prefill_chunk=rng.randint(1, lim.max_num_tokens),
                         enable_prefix_caching=rng.random() < 0.5)  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_every_step_fits_the_recorded_limits(seed):
    rng = random.Random(seed)
    lim, kv, k = _engine_limits(rng)
    profiles = {g: profile_dims(g, lim, kv, k) for g in GRAPH_NAMES}
    for variant in range(2):
        # The engine's own limits first (k drafts at max_seq_len: the widest tables), then a random override.
        rc = RuntimeConfig(max_batch=lim.max_batch, max_num_tokens=lim.max_num_tokens, max_seq_len=lim.max_seq_len,
                           block_size=kv.block_size, num_blocks=kv.num_blocks, num_draft_tokens=k,
                           max_prefill_chunk=lim.max_num_tokens) if variant == 0 else _runtime_config(rng, lim, kv, k)  # fmt: skip
        check_within_engine(rc, lim, kv, k)
        assert rc.max_blocks_per_request <= kv.table_width
        model_cfg, model = cached_model()
        ex = ProfileCheckingExecutor(TorchExecutor(model, rc.num_blocks, rc.block_size), profiles, kv.table_width)
        engine = LLMEngine(ex, model_cfg, rc)
        lengths = [rng.randint(1, rc.max_seq_len - 1) for _ in range(rc.max_batch + 2)]
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=seed, max_tokens=rc.max_seq_len)
        outs = engine.generate(random_prompts(lengths, seed=seed), params)
        assert all(n + len(o.output_ids) == rc.max_seq_len for n, o in zip(lengths, outs, strict=True))
        if variant == 0 and k:  # the run reached the widest table the layout allows
            assert max(dict(s)["max_blocks"] for s in ex.seen["main"]) == kv.table_width


@pytest.mark.parametrize(
    "override, message",
    [(dict(max_batch=5), "max_batch=5 exceeds the engine's limit 4"),
     (dict(max_seq_len=65), "max_seq_len=65 exceeds the engine's limit 64"),
     (dict(num_draft_tokens=3), "num_draft_tokens=3 exceeds the 2"),
     (dict(block_size=8), "block_size=8 differs from the engine's kv.block_size=4")],
)  # fmt: skip
def test_configs_outside_the_engine_are_refused(override, message):
    lim, k = Limits(4, 32, 64), 2
    kv = KVLayout.plan(num_planes=3, num_kv_heads=2, head_dim=8, dtype_code=0, block_size=4, max_batch=4,
                       max_seq_len=64, num_draft_tokens=k)  # fmt: skip
    base = dict(max_batch=4, max_num_tokens=32, max_seq_len=64, block_size=4, num_blocks=kv.num_blocks,
                num_draft_tokens=k)  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        check_within_engine(RuntimeConfig(**{**base, **override}), lim, kv, k)

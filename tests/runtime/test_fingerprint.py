"""The lockstep settings fingerprint (pure): what ranks compare at start-up, and the one-line difference."""

import pytest

from runtime.multirank.fingerprint import first_difference, settings_fingerprint
from tests.runtime.engine_utils import make_engine


def fingerprint(engine, extra=None):
    return settings_fingerprint(engine.executor, engine.model_cfg, engine.cfg, extra)


def test_same_settings_agree_and_a_different_k_is_named():
    a, b = fingerprint(make_engine(2)), fingerprint(make_engine(2))
    assert first_difference([a, b, a]) is None
    c = fingerprint(make_engine(1, max_num_tokens=64))
    assert first_difference([a, a, c]) == ("ranks disagree on runtime.num_draft_tokens: rank 0 has 2, rank 2 has 1; "
                                           "launch every rank with the same engine and flags")  # fmt: skip


def test_fingerprint_covers_model_runtime_and_executor():
    fp = fingerprint(make_engine(2))
    assert fp["executor"] == "TorchExecutor"
    assert {"model.num_hidden_layers", "model.vocab_size", "runtime.max_batch", "runtime.block_size"} <= set(fp)
    assert first_difference([fp, {**fp, "model.num_hidden_layers": 99}]).startswith(
        "ranks disagree on model.num_hidden_layers: rank 0 has ")
    missing = {k: v for k, v in fp.items() if k != "executor"}
    assert "rank 1 has '<missing>'" in first_difference([fp, missing])


def test_the_launch_mapping_is_part_of_the_fingerprint():
    """A rank launched with another --collective-timeout or mapping is named at start-up, not in a hang."""
    engine = make_engine(2)
    a = fingerprint(engine, {"parallel.tp_size": 2, "watchdog.collective_timeout": 60.0})
    b = fingerprint(engine, {"parallel.tp_size": 2, "watchdog.collective_timeout": 5.0})
    assert first_difference([a, b]) == ("ranks disagree on watchdog.collective_timeout: rank 0 has 60.0, rank 1 "
                                        "has 5.0; launch every rank with the same engine and flags")  # fmt: skip


def test_a_host_fact_is_named_first_with_both_hosts_and_its_advice():
    """Across hosts the line names each rank's host; a host fact (installation, CPU ISA) comes before the settings
    it explains (a host without the packages' ISA picks another executor)."""
    from runtime.multirank.host_facts import host_facts

    engine = make_engine(2)
    a = fingerprint(engine, {**host_facts(True), "executor": "CompiledExecutor"})
    b = fingerprint(engine, {**host_facts(True), "executor": "OrtExecutor", "host.cpu_isa": "avx2"})
    line = first_difference([a, b], ["node-a", "node-b"])
    assert line is not None and line.startswith(
        f"ranks disagree on host.cpu_isa: rank 0 (node-a) has {a['host.cpu_isa']!r}, rank 1 (node-b) has 'avx2'; "
        "the engine's compiled packages are native code for one CPU ISA"), line  # fmt: skip
    assert first_difference([a, a], ["node-a", "node-b"]) is None
    one_host = first_difference([a, {**a, "host.plugin_library": "0" * 16}], ["node-a", "node-a"])
    assert one_host is not None and "rank 0 has" in one_host and "make install" in one_host, one_host


def test_host_facts_see_the_installation_and_the_cpu_isa():
    """The facts are read from this installation: every pinned package's version, our kernels' digest, and the
    vector ISA torch would compile for, which ATEN_CPU_CAPABILITY lowers as a CPU without it would (subprocess:
    torch reads it once)."""
    import importlib.metadata
    import json
    import os
    import subprocess
    import sys

    from runtime.multirank.host_facts import PACKAGES, host_facts

    facts = host_facts(False)
    assert facts["host.packages.torch"] == importlib.metadata.version("torch") and "host.cpu_isa" not in facts
    assert set(PACKAGES) <= {k.split(".")[-1] for k in facts} and len(facts["host.plugin_library"]) == 16
    code = "import json; from runtime.multirank.host_facts import host_facts; print(json.dumps(host_facts(True)))"
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        pytest.skip("this process already runs with ATEN_CPU_CAPABILITY=default: nothing to lower")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lowered = json.loads(out.stdout.strip().splitlines()[-1])["host.cpu_isa"]
    assert host_facts(True)["host.cpu_isa"] != lowered, lowered

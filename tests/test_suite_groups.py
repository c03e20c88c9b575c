"""The test suite's own scheduling (tests/conftest.py): under `make test` (pytest-xdist, --dist loadgroup) each test
carries its group in its node id, which is all the scheduler reads. pytest 9 stopped reading the attribute
pytest-xdist 3.8 writes that suffix to, and nothing said so: every group silently fell apart (the wheel and the
multi-rank engines were built once per worker, and two mpirun jobs ran at once)."""

from __future__ import annotations

import os

import pytest


def test_the_xdist_group_reaches_the_scheduler(request):
    if "PYTEST_XDIST_WORKER" not in os.environ or not request.config.getvalue("loadgroup"):
        pytest.skip("checks `make test`'s pytest-xdist run (-n 2 --dist loadgroup)")
    (mark,) = list(request.node.iter_markers("xdist_group"))
    assert request.node.nodeid.endswith(f"@{mark.args[0]}"), request.node.nodeid


def test_costliest_groups_come_first():
    from tests.conftest import costliest_groups_first

    class Item:
        def __init__(self, name, *marks):
            self.name, self.marks = name, [getattr(pytest.mark, m).mark for m in marks]

        def iter_markers(self):
            return iter(self.marks)

    a1, a2, b1, c1 = Item("a1"), Item("a2"), Item("b1", "compile"), Item("c1", "mpi")
    groups = {a1: "a", a2: "a", b1: "b", c1: "c"}
    assert costliest_groups_first([a1, a2, c1, b1], groups) == [b1, c1, a1, a2]


@pytest.mark.parametrize("impl", ["op", "triton"])
def test_a_triton_interpreter_case_is_in_the_triton_tier(request, impl):
    """A kernel test's "triton" case runs the kernel in Triton's CPU interpreter (seconds per case); it carries the
    `triton` tier, which `make test-quick` deselects, and the other cases of the same test do not."""
    assert (request.node.get_closest_marker("triton") is not None) == (impl == "triton")


def test_the_suite_compiles_aoti_wrappers_at_o0():
    """tests/conftest.py's setting must reach Inductor's config (it is read once, when torch._inductor.config is first
    imported): otherwise every compiled build in the suite pays -O1 on its wrappers again, silently."""
    import torch._inductor.config as inductor

    assert inductor.aot_inductor.compile_wrapper_opt_level == "O0"

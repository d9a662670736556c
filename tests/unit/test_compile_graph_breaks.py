"""Graph-break accounting: a deliberate break is counted and reported with its reason, so the
zero-break checks of the compiled models (tests/distributed/compile_composition_checks.py) can fail."""

from __future__ import annotations

import logging

import torch

from parallelisms.compile import graph_break_count, graph_break_reasons, log_graph_breaks


def _compile_with_breaks():
    """A function with two graph breaks (a print and an explicit break), compiled without fullgraph."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        print("graph break test")
        x = x * 2
        torch._dynamo.graph_break()
        return x - 1

    return torch.compile(fn, backend="eager")


def test_deliberate_breaks_are_counted():
    before_count, before_reasons = graph_break_count(), graph_break_reasons()
    compiled = _compile_with_breaks()
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert graph_break_count() - before_count == 2
    new = {r: n - before_reasons.get(r, 0) for r, n in graph_break_reasons().items() if n > before_reasons.get(r, 0)}
    assert len(new) == 2, new
    assert any("print" in reason for reason in new), new
    assert any(reason.startswith("Call to `torch._dynamo.graph_break()`") for reason in new), new
    assert all("\n" not in reason for reason in new)

    # A cached graph is not traced again: calling once more counts nothing.
    compiled(torch.ones(3))
    assert graph_break_count() - before_count == 2


def test_fullgraph_function_counts_nothing():
    before = graph_break_count()
    compiled = torch.compile(lambda x: torch.relu(x) * 2, backend="eager", fullgraph=True)
    compiled(torch.randn(4))
    assert graph_break_count() == before


def test_log_graph_breaks(caplog):
    _compile_with_breaks()(torch.ones(2))
    with caplog.at_level(logging.INFO, logger="parallelisms.compile"):
        count = log_graph_breaks()
    assert count == graph_break_count() >= 2
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert info == [f"compile: {count} graph breaks"]
    assert len(warnings) == len(graph_break_reasons())
    assert any("torch._dynamo.graph_break()" in w for w in warnings)

"""debug.gc_debug (torchtitan's training.gc_debug): every step's full collection warns of the
tensors reference cycles were holding, and frees them."""

from __future__ import annotations

import gc
import logging

import torch

from config.manager import load_config
from trainer.profiling import collect_garbage_held_by_cycles


class _Node:
    pass


def test_a_cycle_holding_a_tensor_is_reported_and_freed(caplog):
    gc.collect()
    gc.disable()  # as the trainer runs: only the step's collection frees cycles
    try:
        node = _Node()
        node.self, node.tensor = node, torch.zeros(2**18)  # 1 MiB only a collection frees
        del node
        with caplog.at_level(logging.WARNING):
            collect_garbage_held_by_cycles()
        # Freed, not only found (a weak reference would not tell: the collector clears those first).
        assert not any(type(obj) is _Node for obj in gc.get_objects())
    finally:
        gc.enable()
    assert [r.getMessage() for r in caplog.records] == [
        "debug.gc_debug: reference cycles held 1 tensors (1.0 MiB), freed by this collection only"
    ]
    assert gc.get_debug() == 0 and gc.garbage == []


def test_nothing_to_report_is_silent(caplog):
    gc.collect()
    with caplog.at_level(logging.WARNING):
        collect_garbage_held_by_cycles()
    assert caplog.records == []


def test_torchtitans_name_sets_it():
    assert load_config(["--training.gc_debug"]).debug.gc_debug

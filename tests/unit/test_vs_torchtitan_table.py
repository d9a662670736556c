"""bench/vs_torchtitan.py's table is the README's: variants in words, the median ratio over the
rounds with their range, bold for the defaults; both sides train a model of the same size."""

from __future__ import annotations

import json

from bench.vs_torchtitan import FLAVOR_LAUNCHER, TITAN_MODEL_FIELDS, VARIANTS, Titan, command, markdown, summarize
from models.llama3 import llama3_flavors

INFO = {"date": "2026-11-27T03:20:08+00:00", "cpu_model": "AMD EPYC", "usable_cores": 2, "torch": "2.13.0"}


def _rounds(pairs: list[tuple[float, float]]) -> list[dict]:
    return [{"torchtitan": {"median_tps": t}, "tessera": {"median_tps": s}} for t, s in pairs]


def test_rows_name_the_variant_and_give_the_median_ratio_with_its_range():
    rows = summarize(
        {
            "defaults_fsdp2_eager": _rounds([(1000.0, 1500.0), (1200.0, 1560.0), (1100.0, 1540.0)]),
            "fp32_1rank_eager": _rounds([(1300.0, 1430.0)]),
        }
    )
    lines = markdown(rows, INFO, "debugmodel").splitlines()
    assert lines[0].endswith("torch 2.13.0, model debugmodel, 1/3 rounds.")
    assert "| **defaults**, FSDP2 eager | 2 | 1,100 | 1,540 | **1.40** (1.30-1.50) |" in lines
    assert "| fp32 both, eager | 1 | 1,300 | 1,430 | 1.10 (1.10-1.10) |" in lines


def test_the_wide_model_is_the_same_size_on_both_sides():
    """torchtitan has no model of the wide flavor's size: it is registered from Tessera's flavor."""
    titan = Titan("/titan/venv/bin/python", "/titan/run", "/anchors/titan_cpu.py")
    variant = VARIANTS["fp32_simplefsdp_auto_vs_fsdp2_compile"]
    titan_argv, _ = command("torchtitan", variant, "debugmodel_wide", titan, 14, "/dump")
    tessera_argv, _ = command("tessera", variant, "debugmodel_wide", titan, 14, "/dump")
    launcher = titan_argv.index(FLAVOR_LAUNCHER)
    assert titan_argv[launcher + 1 : launcher + 3] == [titan.launcher, "debugmodel_wide"]
    fields = json.loads(titan_argv[launcher + 3])
    wide = llama3_flavors["debugmodel_wide"]
    assert fields == {name: getattr(wide, name) for name in TITAN_MODEL_FIELDS}
    assert (fields["dim"], fields["n_layers"]) == (1024, 4)
    for argv in (titan_argv, tessera_argv):
        joined = " ".join(argv)
        assert "--model.flavor debugmodel_wide" in joined
        assert "--training.seq_len 128 --training.local_batch_size 2" in joined
    debug_argv, _ = command("torchtitan", variant, "debugmodel", titan, 14, "/dump")
    assert FLAVOR_LAUNCHER not in debug_argv and titan.launcher in debug_argv

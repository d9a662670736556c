"""bench/vs_torchtitan.py's table is the README's: variants in words, the median ratio over the
rounds with their range, bold for the defaults."""

from __future__ import annotations

from bench.vs_torchtitan import markdown, summarize

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
    lines = markdown(rows, INFO).splitlines()
    assert lines[0].endswith("torch 2.13.0, 1/3 rounds.")
    assert "| **defaults**, FSDP2 eager | 2 | 1,100 | 1,540 | **1.40** (1.30-1.50) |" in lines
    assert "| fp32 both, eager | 1 | 1,300 | 1,430 | 1.10 (1.10-1.10) |" in lines

"""The benchmarks' command lines: an option a mode would ignore is refused, not silently dropped."""

from __future__ import annotations

import pytest

from bench.dp_compare import parse_args, summarize_interleaved, throughput_runs


def test_the_compile_time_table_refuses_a_precision_it_would_not_measure(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--compile-depths", "6,32", "--precisions", "bf16"])
    assert exit_info.value.code == 2
    assert "--precisions" in capsys.readouterr().err


def test_precisions_default_to_both_for_throughput_and_fp32_is_accepted_for_depths():
    assert parse_args([]).precisions == ["fp32", "bf16"]
    assert parse_args(["--compile-depths", "6", "--precisions", "fp32"]).compile_depths == [6]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--interleave", "--variants", "simplefsdp_auto,simplefsdp_block"], "fsdp2_eager"),
        (["--interleave", "--variants", "fsdp2_eager"], "fsdp2_eager"),
        (["--interleave", "--compile-depths", "6"], "--compile-depths"),
        (["--interleave", "--ranks", "1,2", "--ceiling"], "--ceiling"),
    ],
)
def test_interleaving_refuses_what_it_cannot_compare(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_interleaved_launches_hold_every_variant_a_rank_count_runs():
    args = parse_args(["--interleave", "--variants", "fsdp2_eager,simplefsdp_auto,simplefsdp_eager", "--rounds", "2"])
    runs = throughput_runs(args)
    assert len(runs) == 2 * 2 * 2 * 2  # rounds x models x precisions x rank counts
    one_rank, two_ranks = (next(r for r in runs if r.nproc == n) for n in (1, 2))
    assert one_rank.interleaved == ("fsdp2_eager", "simplefsdp_auto")  # no eager SimpleFSDP alone
    assert two_ranks.interleaved == ("fsdp2_eager", "simplefsdp_auto", "simplefsdp_eager")


def _launch(nproc: int, round_index: int, steps: dict[str, list[float]]) -> dict:
    tokens = 100
    return {
        "model": "debugmodel",
        "precision": "fp32",
        "nproc": nproc,
        "round": round_index,
        "ok": True,
        "interleaved": list(steps),
        "per_variant": {
            v: {"step_times_s": t, "tps_per_rank": tokens * len(t) / sum(t), "final_loss": 5.0}
            for v, t in steps.items()
        },
    }


def test_interleaved_rows_set_each_step_against_the_baseline_step_beside_it():
    launches = [
        _launch(2, 0, {"fsdp2_eager": [1.0, 2.0], "simplefsdp_auto": [0.5, 2.0]}),
        _launch(2, 1, {"fsdp2_eager": [3.0, 1.0], "simplefsdp_auto": [2.0, 1.0]}),
        _launch(1, 0, {"fsdp2_eager": [0.5, 0.5], "simplefsdp_auto": [0.4, 0.4]}),
    ]
    rows = {(r["nproc"], r["variant"]): r for r in summarize_interleaved(launches)}
    auto = rows[(2, "simplefsdp_auto")]
    # Per step: 1/0.5, 2/2, 3/2, 1/1 -> 2, 1, 1.5, 1; median 1.25 (the ratio of sums would differ).
    assert auto["step_ratio"]["median"] == pytest.approx(1.25)
    assert auto["step_ratio"]["steps"] == 4
    # Per round tokens/s: 200/2.5 over 200/3 = 1.2 and 200/3 over 200/4 = 4/3.
    assert auto["tps_ratio"]["min"] == pytest.approx(1.2)
    assert auto["tps_ratio"]["max"] == pytest.approx(4 / 3)
    # Scaling: median tokens/s on 2 ranks over 1 rank's: median(80, 66.7) / 250.
    assert auto["scaling"] == pytest.approx((80 + 200 / 3) / 2 / 250)
    assert rows[(2, "fsdp2_eager")]["step_ratio"]["median"] == 1.0

"""The benchmarks' command lines: an option a mode would ignore is refused, not silently dropped."""

from __future__ import annotations

import pytest

from bench.dp_compare import parse_args, summarize_interleaved, throughput_runs
from bench.dp_compare_worker import parse_collectives


def test_the_compile_time_table_refuses_a_precision_it_would_not_measure(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--compile-depths", "6,32", "--precisions", "bf16"])
    assert exit_info.value.code == 2
    assert "--precisions" in capsys.readouterr().err


def test_precisions_default_to_both_for_throughput_and_fp32_is_accepted_for_depths():
    assert parse_args([]).precisions == ["fp32", "bf16"]
    assert parse_args(["--compile-depths", "6", "--precisions", "fp32"]).compile_depths == [6]


def test_quick_shrinks_only_what_is_not_given():
    quick = parse_args(["--quick"])
    assert (quick.precisions, quick.ranks, quick.rounds) == (["fp32"], [2], 1)
    given = parse_args(["--quick", "--precisions", "bf16", "--ranks", "1,2", "--rounds", "2"])
    assert (given.precisions, given.ranks, given.rounds) == (["bf16"], [1, 2], 2)


def _event(name: str, ts: int, types: list[str], dims: list) -> dict:
    return {"ph": "X", "name": name, "tid": 1, "ts": ts, "dur": 1, "args": {"Input type": types, "Input Dims": dims}}


@pytest.mark.parametrize("buffer_dtype, itemsize", [("c10::BFloat16", 2), ("unsigned char", 1), ("float", 4)])
def test_fsdp2_gathers_on_gloo_count_the_bytes_of_the_buffer_they_fill(buffer_dtype, itemsize):
    """FSDP2 gathers on gloo as broadcasts of tensor lists, which the profiler records without a
    dtype: each counts at the dtype of the output buffer FSDP2 filled before it."""
    copy_in = _event("fsdp::all_gather_copy_in", 0, ["TensorList", buffer_dtype], [[[6]], [12]])
    broadcasts = [_event("c10d::broadcast_", ts, ["TensorList", ""], [[[6]], []]) for ts in (2, 3)]
    stats = parse_collectives([copy_in, *broadcasts])
    assert stats.count["broadcast"] == 2 and stats.unknown_dtype == 0
    assert stats.payload_bytes["broadcast"] == 12 * itemsize


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

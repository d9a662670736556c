"""The benchmarks' command lines: an option a mode would ignore is refused, not silently dropped."""

from __future__ import annotations

import pytest

from bench.dp_compare import parse_args


def test_the_compile_time_table_refuses_a_precision_it_would_not_measure(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--compile-depths", "6,32", "--precisions", "bf16"])
    assert exit_info.value.code == 2
    assert "--precisions" in capsys.readouterr().err


def test_precisions_default_to_both_for_throughput_and_fp32_is_accepted_for_depths():
    assert parse_args([]).precisions == ["fp32", "bf16"]
    assert parse_args(["--compile-depths", "6", "--precisions", "fp32"]).compile_depths == [6]

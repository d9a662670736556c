"""Tests for trainer.metrics: peak FLOPs, memory, throughput and the metrics logger."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from parallelisms import device
from parallelisms.device import PeakFlops, device_peak, device_peak_flops, reset_peak_memory
from parallelisms.parallel_dims import ParallelDims
from trainer.data.batch import IGNORE_INDEX, Batch
from trainer.metrics import (
    MetricsLogger,
    RunProgress,
    ThroughputTracker,
    format_duration,
    format_step_line,
    format_summary,
    log_peak,
    peak_memory_gib,
    tokens_of_this_rank,
    tokens_per_source,
)

_JSONL_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tps",
    "tflops",
    "mfu",
    "memory_gib",
    "data_loading_pct",
    "elapsed_s",
}


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------
# Peak FLOPs
# ---------------------------------------------------------------------------


def test_cpu_peak_flops_is_measured_once() -> None:
    flops = device_peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 1e8  # even one slow core does far more than 0.1 GFLOP/s
    assert device_peak_flops(torch.device("cpu"), torch.float32) == flops  # cached, not re-measured


def test_cpu_peak_is_measured_in_the_runs_dtype_and_threads() -> None:
    threads = torch.get_num_threads()
    peak = device_peak(torch.device("cpu"), torch.float32)
    unit = "thread" if threads == 1 else "threads"
    assert peak.source.startswith("measured: ") and peak.source.endswith(f" float32 matmul, {threads} {unit}")
    assert str(peak).startswith("peak ") and " TFLOP/s measured: " in str(peak)


@pytest.fixture
def fake_matmul_rate(monkeypatch: pytest.MonkeyPatch):
    """Makes every CPU matmul take ``2 n^3 / rate`` seconds (the rate set per dtype through the
    returned dict; a missing dtype raises like a dtype without a CPU matmul); no cached peak leaks
    in or out."""
    rates: dict[torch.dtype, float] = {}
    timed_sizes: list[int] = []

    def fake_time(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
        if a.dtype not in rates:
            raise RuntimeError(f'"addmm" not implemented for {a.dtype}')
        timed_sizes.append(a.shape[0])
        return 2 * a.shape[0] ** 3 / rates[a.dtype]

    monkeypatch.setattr(device, "_time_matmul", fake_time)
    device._cpu_matmul_peak.cache_clear()
    yield rates, timed_sizes
    device._cpu_matmul_peak.cache_clear()


def test_cpu_peak_uses_the_largest_size_that_fits_the_budget(fake_matmul_rate, monkeypatch) -> None:
    rates, timed_sizes = fake_matmul_rate
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    # Fast: a 2048 matmul takes 0.017 s, so 2048 is measured, about 0.5 s of them.
    rates[torch.bfloat16] = 1e12
    peak = device_peak(torch.device("cpu"), torch.bfloat16)
    assert peak == PeakFlops(pytest.approx(1e12), "measured: 2048x2048 bfloat16 matmul, 1 thread")
    assert timed_sizes[:4] == [64, 512, 1024, 2048] and 25 <= timed_sizes.count(2048) <= 35
    # Slow: a 2048 matmul would take 0.86 s > half the budget, so 1024 (0.11 s) is the size.
    rates[torch.float32] = 20e9
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    peak = device_peak(torch.device("cpu"), torch.float32)
    assert peak == PeakFlops(pytest.approx(20e9), "measured: 1024x1024 float32 matmul, 4 threads")
    assert str(peak) == "peak 0.02 TFLOP/s measured: 1024x1024 float32 matmul, 4 threads"


def test_cpu_peak_keeps_the_fastest_run(fake_matmul_rate, monkeypatch) -> None:
    rates, _ = fake_matmul_rate
    rates[torch.float32] = 1e12
    calls = iter(range(1000))
    fast_time = device._time_matmul
    # Every other matmul is slowed down three times, as by another process on the same core.
    monkeypatch.setattr(device, "_time_matmul", lambda *args: fast_time(*args) * (3 if next(calls) % 2 else 1))
    peak = device_peak(torch.device("cpu"), torch.float32)
    assert peak.flops == pytest.approx(1e12) and peak.source.startswith("measured: 2048x2048 float32 matmul")


def test_cpu_peak_is_per_thread_count(fake_matmul_rate, monkeypatch) -> None:
    rates, _ = fake_matmul_rate
    rates[torch.float32] = 1e12
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert device_peak(torch.device("cpu"), torch.float32).source.endswith("1 thread")
    rates[torch.float32] = 2e12
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert device_peak(torch.device("cpu"), torch.float32) == PeakFlops(
        pytest.approx(2e12), "measured: 2048x2048 float32 matmul, 2 threads"
    )


def test_cpu_peak_that_cannot_be_measured_gives_no_mfu(fake_matmul_rate, caplog) -> None:
    rates, timed_sizes = fake_matmul_rate
    rates[torch.float16] = 0.1e9  # a 512x512 matmul takes 2.7 s: over the 0.5 s budget
    with caplog.at_level(logging.WARNING, logger="parallelisms.device"):
        assert device_peak(torch.device("cpu"), torch.float16) is None
        assert device_peak_flops(torch.device("cpu"), torch.float16) is None
        # No CPU matmul for this dtype at all.
        assert device_peak(torch.device("cpu"), torch.complex64) is None
    assert timed_sizes == [64, 512]  # gave up after the first size
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("no MFU: a 512x512 float16 matmul takes 2.68 s on this CPU")
    assert messages[1].startswith("no MFU: cannot time a complex64 matmul on this CPU")


def test_peak_flops_override_skips_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("override must not benchmark")

    monkeypatch.setattr(device, "_benchmark_matmul_flops", fail)
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16, override=123e12) == 123e12
    assert str(device_peak(torch.device("cpu"), torch.bfloat16, override=123e12)) == ("peak 123 TFLOP/s as configured")
    with pytest.raises(ValueError, match="override"):
        device_peak_flops(torch.device("cpu"), torch.bfloat16, override=0.0)


def test_log_peak_says_what_mfu_is_against(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        assert log_peak(PeakFlops(2.1e11, "measured: 2048x2048 bfloat16 matmul, 1 thread")) == 2.1e11
        assert log_peak(None) is None
    assert [record.getMessage() for record in caplog.records] == [
        "MFU against peak 0.21 TFLOP/s measured: 2048x2048 bfloat16 matmul, 1 thread",
        "no MFU: the peak FLOP/s of this device is unknown (metrics.peak_flops sets one)",
    ]


@pytest.mark.parametrize(
    ("device_name", "bf16_flops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA A10", 125e12),
        ("AMD Instinct MI300X", 1307.4e12),
    ],
)
def test_known_gpu_peak_flops(monkeypatch: pytest.MonkeyPatch, device_name: str, bf16_flops: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    assert device_peak_flops(torch.device("cuda"), torch.bfloat16) == bf16_flops
    assert device_peak_flops(torch.device("cuda"), torch.float16) == bf16_flops
    assert device_peak(torch.device("cuda"), torch.bfloat16).source == f"datasheet: {device_name}, bfloat16 dense"


def test_gpu_fp32_peak_depends_on_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    # cuBLAS flags are not plain attributes, so monkeypatch cannot restore them.
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert device_peak_flops(torch.device("cuda"), torch.float32) == 19.5e12
        torch.backends.cuda.matmul.allow_tf32 = True
        assert device_peak_flops(torch.device("cuda"), torch.float32) == 156e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def test_unknown_gpu_is_benchmarked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    measured = PeakFlops(42.0, "measured: 4096x4096 bfloat16 matmul")
    monkeypatch.setattr(device, "_benchmark_matmul_flops", lambda device, dtype: measured)
    assert device_peak_flops(torch.device("cuda"), torch.bfloat16) == 42.0
    assert device_peak(torch.device("cuda"), torch.bfloat16) == measured


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def test_cpu_peak_memory_tracks_allocations() -> None:
    device = torch.device("cpu")
    reset_peak_memory(device)
    before = peak_memory_gib(device)
    assert before > 0
    block = torch.ones(64 * 1024**2)  # 256 MiB, touched so it is resident
    after = peak_memory_gib(device)
    del block
    assert after - before >= 0.2


# ---------------------------------------------------------------------------
# Throughput
# ---------------------------------------------------------------------------


def test_throughput_summary_matches_hand_computation() -> None:
    clock = FakeClock(100.0)
    tracker = ThroughputTracker(clock=clock)
    tracker.add_tokens(4096)
    with tracker.data_loading():
        clock.now += 0.5
    tracker.add_tokens(4096)
    with tracker.data_loading():
        clock.now += 0.25
    clock.now = 104.0

    summary = tracker.summarize(num_flops_per_token=6e9, peak_flops=1e15)
    # 8192 tokens in 4 s; 6e9 flop/token -> 12.288 TFLOP/s -> 1.2288 % of 1 PFLOP/s.
    assert summary == pytest.approx(
        {"tps": 2048.0, "tflops": 12.288, "mfu": 1.2288, "data_loading_pct": 18.75}, rel=1e-12
    )

    # The window restarted at 104 s: 1000 tokens in 0.5 s, no data loading.
    tracker.add_tokens(1000)
    clock.now = 104.5
    summary = tracker.summarize(num_flops_per_token=1e9, peak_flops=4e12)
    assert summary == pytest.approx({"tps": 2000.0, "tflops": 2.0, "mfu": 50.0, "data_loading_pct": 0.0})


@pytest.mark.parametrize("tp, pp, share", [(1, 1, 512), (2, 1, 256), (1, 2, 256), (2, 2, 128)])
def test_a_rank_counts_its_share_of_the_tokens_its_tensor_and_pipeline_peers_see(tp, pp, share) -> None:
    """Every rank of a tensor-parallel group (and of a pipeline) sees its data-parallel rank's
    whole batch, two microbatches of 2 x 128 here: tokens/s per rank count 1/(tp x pp) of it, or
    a TP rank's tokens/s and MFU would read tp times too high."""
    batch = [Batch(torch.zeros(2, 128, dtype=torch.long), torch.zeros(2, 128, dtype=torch.long))] * 2
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=tp, pp=pp, world_size=2 * tp * pp)
    assert tokens_of_this_rank(batch, dims) == share


def test_tokens_count_the_trained_labels_in_all_and_per_source() -> None:
    """Ignored labels (a chat's prompts, a document's last token) feed neither tokens/s nor MFU."""
    labels = torch.tensor([[1, IGNORE_INDEX, 2, 3], [IGNORE_INDEX, IGNORE_INDEX, 4, 5], [6, 7, 8, 9]])
    batch = Batch(torch.zeros(3, 4, dtype=torch.long), labels, sources=torch.tensor([2, 0, 2]))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    assert tokens_of_this_rank([batch, batch], dims) == 2 * 9
    assert tokens_per_source([batch, batch], 3).tolist() == [4, 0, 14]


def test_tokens_per_source_go_to_the_console_jsonl_and_tensorboard(tmp_path: Path, caplog) -> None:
    metrics_logger = MetricsLogger(
        str(tmp_path), enable=True, enable_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"), total_steps=4
    )
    per_source = {"web.jsonl": 1200, "code.jsonl": 34}
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        metrics_logger.start(0)
        metrics_logger.step_done(1, 2.0)
        metrics_logger.log(1, _step_metrics(1), per_source)
    metrics_logger.close()
    assert "| tokens web.jsonl 1,200, code.jsonl 34" in caplog.text
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["tokens_per_source"] == per_source
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [event.value for event in accumulator.Scalars("tokens_per_source/code.jsonl")] == [34]


def test_throughput_without_a_peak_has_no_mfu() -> None:
    clock = FakeClock(100.0)
    tracker = ThroughputTracker(clock=clock)
    tracker.add_tokens(1000)
    clock.now += 0.5
    summary = tracker.summarize(num_flops_per_token=1e9, peak_flops=None)
    assert math.isnan(summary.pop("mfu"))
    assert summary == pytest.approx({"tps": 2000.0, "tflops": 2.0, "data_loading_pct": 0.0})


def test_throughput_empty_window_is_zero() -> None:
    tracker = ThroughputTracker(clock=FakeClock())
    assert tracker.summarize(num_flops_per_token=1.0, peak_flops=1.0) == {
        "tps": 0.0,
        "tflops": 0.0,
        "mfu": 0.0,
        "data_loading_pct": 0.0,
    }


# ---------------------------------------------------------------------------
# MetricsLogger
# ---------------------------------------------------------------------------


def _step_metrics(step: int) -> dict[str, float]:
    return {
        "loss": 10.0 / step,
        "grad_norm": 0.5 * step,
        "lr": 3e-4 * step,
        "tps": 1000.0 + step,
        "tflops": 1.5 * step,
        "mfu": 2.5 * step,
        "memory_gib": 0.25 * step,
        "data_loading_pct": 1.0 * step,
    }


def test_metrics_logger_writes_console_jsonl_and_tensorboard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tensorboard_dir = tmp_path / "tb"
    clock = FakeClock(100.0)
    metrics_logger = MetricsLogger(
        str(tmp_path / "dump"),
        enable=True,
        enable_tensorboard=True,
        tensorboard_dir=str(tensorboard_dir),
        total_steps=10,
        clock=clock,
    )
    steps = [1, 2, 5]
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        metrics_logger.start(0)
        for step in range(1, 6):
            clock.now += 2.0
            metrics_logger.step_done(step, _step_metrics(step)["loss"])
            if step in steps:
                metrics_logger.log(step, _step_metrics(step))
    metrics_logger.close()

    console = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(console) == len(steps)
    assert console[-1] == (
        "step 5/10 (50%) | loss 2.0000 | grad_norm 2.5000 | lr 1.500e-03 | tps/rank 1,005 | tflops/rank 7.5"
        " | mfu 12.5% | memory 1.25 GiB | data 5.0% | elapsed 10s | eta 10s"
    )
    assert console[0].endswith("| elapsed 2s")  # no rate yet after the first step: no ETA

    lines = (tmp_path / "dump" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [set(record) for record in records] == [_JSONL_KEYS] * len(steps)
    for record, step in zip(records, steps):
        assert record == {"step": step} | _step_metrics(step) | {"elapsed_s": 2.0 * step}

    accumulator = EventAccumulator(str(tensorboard_dir))
    accumulator.Reload()
    tags = {
        "loss/global_avg": "loss",
        "grad_norm": "grad_norm",
        "lr": "lr",
        "throughput/tps": "tps",
        "throughput/tflops": "tflops",
        "throughput/mfu_pct": "mfu",
        "memory/peak_gib": "memory_gib",
        "time/data_loading_pct": "data_loading_pct",
    }
    assert set(tags) == set(accumulator.Tags()["scalars"])
    for tag, key in tags.items():
        events = accumulator.Scalars(tag)
        assert [event.step for event in events] == steps
        # TensorBoard stores float32.
        assert [event.value for event in events] == pytest.approx(
            [_step_metrics(step)[key] for step in steps], rel=1e-6
        )


def test_metrics_logger_jsonl_is_flushed_per_line_and_nan_is_null(tmp_path: Path) -> None:
    metrics_logger = MetricsLogger(str(tmp_path), enable=True, enable_tensorboard=False, tensorboard_dir="")
    metrics_logger.log(7, _step_metrics(7) | {"loss": math.nan, "grad_norm": math.inf})
    # Read before close(): the line must already be on disk.
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 7 and record["loss"] is None and record["grad_norm"] is None
    assert set(record) == _JSONL_KEYS
    with pytest.raises(KeyError, match="mfu"):
        metrics_logger.log(8, {key: value for key, value in _step_metrics(8).items() if key != "mfu"})
    metrics_logger.close()
    assert list(tmp_path.iterdir()) == [tmp_path / "metrics.jsonl"]  # no TensorBoard files


def test_a_run_from_step_0_moves_an_earlier_runs_records_aside(tmp_path: Path, caplog) -> None:
    """Rerunning from scratch in a folder: the earlier run's metrics and validation records move to
    files named after their last write (steps 1, 2, 1, 3 in one file would make step 2 look like
    the new run's); a resumed run, or torchrun's restart of the same launch, appends."""

    def run(start: int, steps: list[int], new_run: bool = True) -> None:
        metrics_logger = MetricsLogger(str(tmp_path), enable=True, enable_tensorboard=False, tensorboard_dir="")
        metrics_logger.start(start, new_run=new_run)
        for step in steps:
            metrics_logger.log(step, _step_metrics(step))
        metrics_logger.log_validation(steps[-1], 1.0)
        metrics_logger.close()

    def steps_in(path: Path) -> list[int]:
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    run(0, [1, 2])
    earlier = time.strftime("%Y%m%d-%H%M%S", time.localtime((tmp_path / "metrics.jsonl").stat().st_mtime))
    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        run(0, [1, 3])
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 3] and steps_in(tmp_path / "validation.jsonl") == [3]
    assert steps_in(tmp_path / f"metrics.{earlier}.jsonl") == [1, 2]
    assert steps_in(tmp_path / f"validation.{earlier}.jsonl") == [2]
    assert f"holds an earlier run's records; moved to {tmp_path / f'metrics.{earlier}.jsonl'}" in caplog.text
    run(3, [4], new_run=False)  # resumed after step 3
    run(0, [1], new_run=False)  # restarted from scratch by torchrun: the same launch
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 3, 4, 1]
    os.utime(tmp_path / "metrics.jsonl", (0, 0))
    epoch = time.strftime("%Y%m%d-%H%M%S", time.localtime(0))
    (tmp_path / f"metrics.{epoch}.jsonl").write_text("")
    run(0, [1])  # a file of that second exists already: the next name
    assert steps_in(tmp_path / f"metrics.{epoch}-1.jsonl") == [1, 3, 4, 1]


def test_a_run_from_step_0_moves_an_earlier_runs_tensorboard_events_aside(tmp_path: Path, caplog) -> None:
    """The same job.run_name launched again from scratch: the earlier run's event files move to a
    folder beside the run's (TensorBoard lists it as a run of its own) instead of being drawn as
    one curve with the new run's; a resumed run writes beside its own earlier events."""
    tensorboard_dir = tmp_path / "tb" / "run"

    def run(start: int, steps: list[int], new_run: bool = True) -> None:
        metrics_logger = MetricsLogger(
            str(tmp_path), enable=True, enable_tensorboard=True, tensorboard_dir=str(tensorboard_dir)
        )
        metrics_logger.start(start, new_run=new_run)
        for step in steps:
            metrics_logger.log(step, _step_metrics(step))
        metrics_logger.close()

    def steps_in(folder: Path) -> list[int]:
        accumulator = EventAccumulator(str(folder))
        accumulator.Reload()
        return [event.step for event in accumulator.Scalars("loss/global_avg")]

    run(0, [1, 2])
    last_write = max(path.stat().st_mtime for path in tensorboard_dir.iterdir())
    earlier = tmp_path / "tb" / f"run.{time.strftime('%Y%m%d-%H%M%S', time.localtime(last_write))}"
    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        run(0, [1, 3])
    assert steps_in(tensorboard_dir) == [1, 3] and steps_in(earlier) == [1, 2]
    assert f"{tensorboard_dir} holds an earlier run's TensorBoard events; moved to {earlier}" in caplog.text
    run(3, [4], new_run=False)  # resumed after step 3
    assert steps_in(tensorboard_dir) == [1, 3, 4] and sorted(p.name for p in (tmp_path / "tb").iterdir()) == [
        "run",
        earlier.name,
    ]
    # Restarted after step 3 again: step 4 is logged anew, and the earlier attempt's step 4 is
    # purged, so the curve does not run back from 4 to 4.
    run(3, [4, 5], new_run=False)
    assert steps_in(tensorboard_dir) == [1, 3, 4, 5]


def test_a_wandb_run_that_cannot_start_is_a_warning_and_logging_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    wandb = pytest.importorskip("wandb")

    def unreachable(**settings):
        raise RuntimeError("Timed out while retrying: no such host")

    monkeypatch.setattr(wandb, "init", unreachable)
    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        metrics_logger = MetricsLogger(
            str(tmp_path), enable=True, enable_tensorboard=False, tensorboard_dir="", wandb_run={"name": "x"}
        )
    metrics_logger.log(1, _step_metrics(1))
    metrics_logger.log_validation(1, 2.5)
    metrics_logger.close()
    assert [r.getMessage() for r in caplog.records] == [
        "metrics.enable_wandb: no W&B run (Timed out while retrying: no such host); the metrics go to the other logs"
    ]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_non_logging_rank_writes_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dump_folder, tensorboard_dir = tmp_path / "dump", tmp_path / "tb"
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        metrics_logger = MetricsLogger(
            str(dump_folder), enable=False, enable_tensorboard=False, tensorboard_dir=str(tensorboard_dir)
        )
        metrics_logger.log(1, _step_metrics(1))
        metrics_logger.log_validation(1, 2.5)
        metrics_logger.close()
    assert list(tmp_path.iterdir()) == []
    assert caplog.records == []


def test_non_logging_rank_writes_only_its_tensorboard_when_asked(tmp_path: Path) -> None:
    """metrics.save_for_all_ranks: the other ranks write TensorBoard, no console line, no JSON lines."""
    dump_folder, tensorboard_dir = tmp_path / "dump", tmp_path / "tb"
    metrics_logger = MetricsLogger(
        str(dump_folder), enable=False, enable_tensorboard=True, tensorboard_dir=str(tensorboard_dir)
    )
    metrics_logger.start(0)
    metrics_logger.log(1, _step_metrics(1))
    metrics_logger.log_validation(1, 2.5)
    metrics_logger.close()
    assert list(tmp_path.iterdir()) == [tensorboard_dir]
    accumulator = EventAccumulator(str(tensorboard_dir))
    accumulator.Reload()
    assert {"memory/peak_gib", "validation/loss"} <= set(accumulator.Tags()["scalars"])


def test_metrics_logger_without_a_peak_prints_and_plots_no_mfu(tmp_path: Path, caplog) -> None:
    metrics_logger = MetricsLogger(str(tmp_path), enable=True, enable_tensorboard=True, tensorboard_dir=str(tmp_path))
    metrics_logger.start(0)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        metrics_logger.log(3, _step_metrics(3) | {"mfu": math.nan})
    metrics_logger.close()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert line.startswith("step 3 | loss") and "mfu" not in line and "| tflops/rank 4.5 | memory 0.75 GiB" in line
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(record) == _JSONL_KEYS and record["mfu"] is None
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert (
        "throughput/mfu_pct" not in accumulator.Tags()["scalars"] and "throughput/tps" in accumulator.Tags()["scalars"]
    )


# ---------------------------------------------------------------------------
# Console: durations, progress, the step line and the summary
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.4, "0s"),
        (45.0, "45s"),
        (59.4, "59s"),
        (59.6, "1m00s"),
        (250.0, "4m10s"),
        (599.0, "9m59s"),
        (599.6, "10m"),  # from 10 minutes on, to the minute
        (1800.0, "30m"),
        (1829.0, "30m"),
        (1831.0, "31m"),
        (3569.0, "59m"),
        (3599.0, "1h00m"),
        (3720.0, "1h02m"),
        (86_399.0, "1d00h"),
        (2 * 86_400 + 3 * 3600, "2d03h"),
        (-1.0, "?"),
        (math.inf, "?"),
        (math.nan, "?"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_run_progress_eta_uses_the_recent_rate_without_the_first_step() -> None:
    clock = FakeClock(0.0)
    progress = RunProgress(100, clock=clock)
    progress.start(0)
    clock.now = 30.0  # the first step pays for warm-up and compilation
    progress.step_done(1, 5.0)
    assert progress.eta() is None  # no rate from one point
    for step in range(2, 11):
        clock.now += 2.0
        progress.step_done(step, 5.0)
    assert progress.elapsed() == 48.0
    assert progress.eta() == pytest.approx(90 * 2.0)  # 2 s/step, not (48 s / 10 steps)

    # Only the last 50 steps count: the run slows down to 4 s/step.
    progress = RunProgress(200, clock=clock)
    progress.start(0)
    for step in range(1, 101):
        clock.now += 2.0 if step <= 50 else 4.0
        progress.step_done(step, 5.0)
    assert progress.eta() == pytest.approx(100 * 4.0)


def test_run_progress_restarts_the_rate_after_a_rollback_and_has_no_eta_at_the_end() -> None:
    clock = FakeClock(0.0)
    progress = RunProgress(10, clock=clock)
    progress.start(0)
    for step in (1, 2, 3, 4):
        clock.now += 1.0
        progress.step_done(step, 5.0)
    clock.now += 100.0  # a rollback to step 2 and its reload
    progress.step_done(3, 5.0)
    assert progress.eta() is None
    clock.now += 3.0
    progress.step_done(4, 5.0)
    assert progress.eta() == pytest.approx(6 * 3.0)
    for step in range(5, 11):
        progress.step_done(step, 5.0)
    assert progress.eta() is None  # done


def test_step_line_reads_like_the_readme() -> None:
    values = {
        "loss": 5.12341,
        "grad_norm": 0.43212,
        "lr": 8e-4,
        "tps": 1234.4,
        "tflops": 0.05,
        "mfu": 12.34,
        "memory_gib": 0.951,
        "data_loading_pct": 0.12,
    }
    assert format_step_line(120, 1000, values, elapsed=250.0, eta=1800.0) == (
        "step 120/1000 (12%) | loss 5.1234 | grad_norm 0.4321 | lr 8.000e-04 | tps/rank 1,234 | tflops/rank 0.05"
        " | mfu 12.3% | memory 0.95 GiB | data 0.1% | elapsed 4m10s | eta 30m"
    )
    # Unknown peak and rate: no MFU and no ETA; no total: no progress; large rates stay readable.
    values |= {"mfu": math.nan, "tflops": 312.49, "tps": 1_234_567.0}
    assert format_step_line(999, 1000, values, elapsed=3720.0, eta=None) == (
        "step 999/1000 (99%) | loss 5.1234 | grad_norm 0.4321 | lr 8.000e-04 | tps/rank 1,234,567"
        " | tflops/rank 312 | memory 0.95 GiB | data 0.1% | elapsed 1h02m"
    )
    assert format_step_line(7, None, values, elapsed=45.0, eta=None).startswith("step 7 | loss 5.1234 |")


def _progress(clock: FakeClock, start_step: int, losses: dict[int, float], seconds_per_step: float) -> RunProgress:
    progress = RunProgress(60, clock=clock)
    progress.start(start_step)
    for step, loss in losses.items():
        clock.now += seconds_per_step
        progress.step_done(step, loss)
    return progress


def test_summary_of_a_fresh_run() -> None:
    progress = _progress(FakeClock(), 0, {1: 7.5, 2: 6.25, 3: 6.5}, seconds_per_step=20.0)
    folders = {"metrics": "out/metrics.jsonl", "tensorboard": None, "checkpoints": "out/checkpoint", "hf export": None}
    assert format_summary(progress, 8192, folders).splitlines() == [
        "training finished at step 3/60",
        "  wall time   1m00s for 3 steps",
        "  tokens      24,576 (global, 8,192 per step)",
        "  loss        final 6.5000 (step 3), best 6.2500 (step 2)",
        "  metrics     out/metrics.jsonl",
        "  checkpoints out/checkpoint",
    ]


def test_summary_of_a_resumed_run_names_every_folder() -> None:
    losses = {step: 10.0 - 0.1 * step for step in range(5, 61)} | {58: 1.0}
    progress = _progress(FakeClock(), 4, losses, seconds_per_step=70.0)
    folders = {
        "metrics": "out/metrics.jsonl",
        "tensorboard": "out/tb/run",
        "checkpoints": "out/checkpoint",
        "hf export": "out/checkpoint/hf",
    }
    assert format_summary(progress, 100, folders).splitlines() == [
        "training finished at step 60/60",
        "  wall time   1h05m for 56 steps (resumed from step 4)",
        "  tokens      5,600 (global, 100 per step)",
        "  loss        final 4.0000 (step 60), best 1.0000 (step 58)",
        "  metrics     out/metrics.jsonl",
        "  tensorboard out/tb/run",
        "  checkpoints out/checkpoint",
        "  hf export   out/checkpoint/hf",
    ]


def test_summary_when_no_step_was_left_to_run() -> None:
    progress = _progress(FakeClock(), 60, {}, seconds_per_step=1.0)
    assert format_summary(progress, 100, {"metrics": "m.jsonl"}).splitlines() == [
        "training finished at step 60/60",
        "  wall time   0s for 0 steps (resumed from step 60)",
        "  tokens      0 (global, 100 per step)",
        "  metrics     m.jsonl",
    ]


def test_metrics_logger_summary_on_the_logging_rank_only(tmp_path: Path, caplog) -> None:
    clock = FakeClock()
    loggers = [
        MetricsLogger(
            str(tmp_path / f"rank{rank}"),
            enable=rank == 0,
            enable_tensorboard=rank == 0,
            tensorboard_dir=str(tmp_path / "tb"),
            total_steps=2,
            tokens_per_step=512,
            clock=clock,
        )
        for rank in (0, 1)
    ]
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        for metrics_logger in loggers:
            metrics_logger.start(0)
        for step, loss in ((1, 3.0), (2, 2.0)):
            clock.now += 45.0
            for metrics_logger in loggers:
                metrics_logger.step_done(step, loss)
        for metrics_logger in loggers:
            metrics_logger.summary(checkpoint_folder=str(tmp_path / "ckpt"))
            metrics_logger.close()
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training finished")]
    assert summary.splitlines() == [
        "training finished at step 2/2",
        "  wall time   1m30s for 2 steps",
        "  tokens      1,024 (global, 512 per step)",
        "  loss        final 2.0000 (step 2), best 2.0000 (step 2)",
        f"  metrics     {tmp_path / 'rank0' / 'metrics.jsonl'}",
        f"  tensorboard {tmp_path / 'tb'}",
        f"  checkpoints {tmp_path / 'ckpt'}",
    ]

"""Training metrics: peak memory, throughput and logging.

The global loss average across data-parallel ranks is computed by the trainer;
this module only formats and writes what it is given, on the logging rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from parallelisms.device import PeakFlops

logger = logging.getLogger(__name__)

_GIB = 1024**3


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory in GiB since the last reset: CUDA max allocated, CPU peak RSS of this process."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _GIB
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux but in bytes on macOS.
    return (max_rss if sys.platform == "darwin" else max_rss * 1024) / _GIB


def log_peak(peak: PeakFlops | None) -> float | None:
    """Says what MFU is measured against (or that there is no MFU); returns the peak FLOP/s."""
    if peak is None:
        logger.info("no MFU: the peak FLOP/s of this device is unknown (metrics.peak_flops sets one)")
        return None
    logger.info("MFU against %s", peak)
    return peak.flops


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (e.g. after each log)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Linux resets the RSS high-water mark that getrusage reports when "5" is
    # written here; elsewhere the CPU peak covers the whole process lifetime.
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        logger.debug("Cannot reset the peak RSS; CPU peak memory is the process lifetime peak")


class ThroughputTracker:
    """Accumulates tokens, data-loading time and wall time between two logs.

    Count only the tokens this rank processed, so the rates are per rank.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` returns seconds; tests inject a fake one."""
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Start a new window now."""
        self.window_start: float = self._clock()
        self.tokens: int = 0
        self.data_loading_seconds: float = 0.0

    def add_tokens(self, num_tokens: int) -> None:
        """Count tokens processed by this rank (e.g. ``batch * seq_len`` per step)."""
        self.tokens += num_tokens

    def add_data_loading_time(self, seconds: float) -> None:
        """Count time spent waiting for the next batch."""
        self.data_loading_seconds += seconds

    @contextlib.contextmanager
    def data_loading(self) -> Iterator[None]:
        """Time the enclosed block as data loading: ``with tracker.data_loading(): batch = next(it)``."""
        start = self._clock()
        try:
            yield
        finally:
            self.add_data_loading_time(self._clock() - start)

    def summarize(self, num_flops_per_token: float, peak_flops: float | None) -> dict[str, float]:
        """Rates over the window since the last reset, then start a new window.

        Returns:
            ``tps`` (tokens/s), ``tflops`` (achieved TFLOP/s), ``mfu`` (percent of
            ``peak_flops``; NaN when the peak is unknown) and ``data_loading_pct``
            (percent of wall time), all per rank. Zero rates for an empty
            (zero-length) window.
        """
        elapsed = self._clock() - self.window_start
        tps = self.tokens / elapsed if elapsed > 0 else 0.0
        achieved_flops = num_flops_per_token * tps
        summary = {
            "tps": tps,
            "tflops": achieved_flops / 1e12,
            "mfu": 100.0 * achieved_flops / peak_flops if peak_flops else math.nan,
            "data_loading_pct": 100.0 * self.data_loading_seconds / elapsed if elapsed > 0 else 0.0,
        }
        self.reset()
        return summary


# Keys of every metrics.jsonl line after "step", in order, and their TensorBoard tags.
_TENSORBOARD_TAGS = {
    "loss": "loss/global_avg",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tps": "throughput/tps",
    "tflops": "throughput/tflops",
    "mfu": "throughput/mfu_pct",
    "memory_gib": "memory/peak_gib",
    "data_loading_pct": "time/data_loading_pct",
}


def _json_number(value: float) -> float | None:
    # Strict JSON has no NaN/Infinity; null keeps each line parseable by any tool.
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Writes per-step metrics to the console, ``metrics.jsonl`` and TensorBoard.

    Construct it on every rank with ``enable`` true only on the logging rank; the
    other ranks' instances do nothing (no console line, no file).

    ``log`` expects the keys ``loss, grad_norm, lr, tps, tflops, mfu, memory_gib,
    data_loading_pct`` (``mfu`` and ``data_loading_pct`` in percent, ``mfu`` NaN when the peak is
    unknown).
    """

    def __init__(
        self,
        dump_folder: str,
        *,
        enable: bool,
        enable_tensorboard: bool,
        tensorboard_dir: str,
    ) -> None:
        self.enabled = enable
        self._jsonl = None
        self._tensorboard: Any = None  # SummaryWriter; imported lazily, it pulls in tensorboard
        if not enable:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(tensorboard_dir)
            logger.info("TensorBoard logs in %s", tensorboard_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of ``step`` (see the class docstring for the keys)."""
        if not self.enabled:
            return
        missing = [key for key in _TENSORBOARD_TAGS if key not in metrics]
        if missing:
            raise KeyError(f"MetricsLogger.log: missing metrics {missing}")
        values = {key: float(metrics[key]) for key in _TENSORBOARD_TAGS}
        logger.info(
            "step %d | loss %.4f | grad_norm %.4f | lr %.3e | tps/rank %s | tflops/rank %.2f"
            " | mfu %.2f%% | memory %.2f GiB | data loading %.1f%%",
            step,
            values["loss"],
            values["grad_norm"],
            values["lr"],
            f"{values['tps']:,.0f}",
            values["tflops"],
            values["mfu"],
            values["memory_gib"],
            values["data_loading_pct"],
        )

        record = {"step": step} | {key: _json_number(value) for key, value in values.items()}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()  # a crash must not lose the lines before it

        if self._tensorboard is not None:
            for key, tag in _TENSORBOARD_TAGS.items():
                if math.isfinite(values[key]) or key != "mfu":  # no MFU point when the peak is unknown
                    self._tensorboard.add_scalar(tag, values[key], step)

    def log_validation(self, step: int, loss: float) -> None:
        """Record a validation loss: console, ``validation.jsonl`` and TensorBoard ``validation/loss``."""
        if not self.enabled:
            return
        logger.info("step %d | validation loss %.4f", step, loss)
        with open(os.path.join(os.path.dirname(self.jsonl_path), "validation.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "loss": _json_number(loss)}) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.add_scalar("validation/loss", loss, step)

    def close(self) -> None:
        """Flush and close the files; further ``log`` calls are no-ops."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        self.enabled = False

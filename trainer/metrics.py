"""Training metrics: peak memory, throughput, and the logs (console, JSON lines, TensorBoard, W&B)
of the global values the trainer computes."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from config.errors import ConfigError, first_line
from config.evaluation import EVALUATION_FILE
from config.job_config import METRICS_FILE, VALIDATION_FILE, JobConfig
from parallelisms.device import PeakFlops, peak_memory_bytes
from parallelisms.parallel_dims import ParallelDims
from trainer.data.batch import IGNORE_INDEX, Batch
from trainer.folders import free_path

logger = logging.getLogger(__name__)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory in GiB since the last reset: CUDA max allocated, CPU peak RSS of this process."""
    return peak_memory_bytes(device) / 2**30


def log_peak(peak: PeakFlops | None) -> float | None:
    if peak is None:
        logger.info("no MFU: the peak FLOP/s of this device is unknown (metrics.peak_flops sets one)")
        return None
    logger.info("MFU against %s", peak)
    return peak.flops


class ThroughputTracker:
    """Tokens, data-loading time and wall time of this rank between two logs."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self.window_start: float = self._clock()
        self.tokens: int = 0
        self.data_loading_seconds: float = 0.0

    def add_tokens(self, num_tokens: int) -> None:
        self.tokens += num_tokens

    @contextlib.contextmanager
    def data_loading(self) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self.data_loading_seconds += self._clock() - start

    def summarize(self, num_flops_per_token: float, peak_flops: float | None) -> dict[str, float]:
        """Per-rank rates over the window, which starts anew; ``mfu`` is NaN when the peak is unknown."""
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


def tokens_of_this_rank(microbatches: list[Batch], dims: ParallelDims) -> int:
    """This rank's share of the trained labels (those not ``IGNORE_INDEX``): a TP group's and a
    pipeline's ranks all see their DP rank's batch (as torchtitan counts)."""
    return sum(int((batch.labels != IGNORE_INDEX).sum()) for batch in microbatches) // (dims.pp * dims.tp)


def tokens_per_source(microbatches: list[Batch], num_sources: int) -> torch.Tensor:
    """This DP rank's trained labels of each source (int64 [num_sources]), from ``Batch.sources``."""
    counts = torch.zeros(num_sources, dtype=torch.int64)
    for batch in microbatches:
        per_window = (batch.labels != IGNORE_INDEX).sum(dim=1).cpu()
        counts.index_add_(0, batch.sources.cpu(), per_window)
    return counts


class SourceTokens:
    """The trained labels of each source on all DP ranks since the last log, with several corpora."""

    def __init__(self, names: list[str], dims: ParallelDims) -> None:
        self.names = list(names)
        self.dims = dims
        self.counts = torch.zeros(len(self.names), dtype=torch.int64)

    def add(self, microbatches: list[Batch]) -> None:
        if microbatches[0].sources is not None:
            self.counts += tokens_per_source(microbatches, len(self.names))

    def take(self, device: torch.device) -> dict[str, int] | None:
        """The counts by source name, summed over the DP ranks (a collective), then zero; None with one source."""
        if len(self.names) < 2:
            return None
        counts = self.counts.to(device, copy=True)  # the count starts anew below
        # Context-parallel ranks count the labels of their own chunks.
        if self.dims.dp_cp_mesh is not None:
            dist.all_reduce(counts, group=self.dims.dp_cp_mesh.get_group())
        self.counts.zero_()
        return dict(zip(self.names, counts.tolist()))


def format_duration(seconds: float) -> str:
    """``45s``, ``4m10s``, ``30m``, ``1h02m``, ``2d03h``; ``?`` when unknown."""
    if not (math.isfinite(seconds) and seconds >= 0):
        return "?"
    if round(seconds) < 60:
        return f"{round(seconds)}s"
    if round(seconds) < 600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes}m{rest:02d}s"
    hours, minutes = divmod(round(seconds / 60), 60)
    if hours == 0:
        return f"{minutes}m"
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days}d{hours:02d}h"


class RunProgress:
    """Where a run stands: wall time, the recent step rate (for the ETA), the steps run and the losses seen."""

    def __init__(self, total_steps: int | None, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total_steps = total_steps
        self._clock = clock
        self.start(0)

    def start(self, step: int) -> None:
        """Training starts (again) after ``step``: 0 for a fresh run, the step resumed from otherwise."""
        self.start_time = self._clock()
        self.start_step = step
        self.steps_run = 0
        self.last: tuple[int, float] | None = None  # (step, loss)
        self.best: tuple[int, float] | None = None
        # The ETA's rate: the last 50 steps', never the first step's (warm-up and compilation).
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=51)

    def step_done(self, step: int, loss: float) -> None:
        if self._recent and step <= self._recent[-1][1]:
            self._recent.clear()  # rolled back: the rate restarts
        self._recent.append((self._clock(), step))
        self.steps_run += 1
        self.last = (step, loss)
        if math.isfinite(loss) and (self.best is None or loss < self.best[1]):
            self.best = (step, loss)

    def elapsed(self) -> float:
        return self._clock() - self.start_time

    def eta(self) -> float | None:
        """Seconds left at the recent step rate; None before two steps, without a total, or at the end."""
        if self.total_steps is None or len(self._recent) < 2 or self._recent[-1][1] >= self.total_steps:
            return None
        (first_time, first_step), (last_time, last_step) = self._recent[0], self._recent[-1]
        return (last_time - first_time) / (last_step - first_step) * (self.total_steps - last_step)


# Each metrics.jsonl line's keys after "step", in order (then "elapsed_s"): TensorBoard tag, console field.
_METRICS = {
    "loss": ("loss/global_avg", "loss {:.4f}"),
    "grad_norm": ("grad_norm", "grad_norm {:.4f}"),
    "lr": ("lr", "lr {:.3e}"),
    "tps": ("throughput/tps", "tps/rank {:,.0f}"),
    "tflops": ("throughput/tflops", "tflops/rank {:.3g}"),
    "mfu": ("throughput/mfu_pct", "mfu {:.1f}%"),
    "memory_gib": ("memory/peak_gib", "memory {:.2f} GiB"),
    "data_loading_pct": ("time/data_loading_pct", "data {:.1f}%"),
}
# A run's own, when it has them (fault_tolerance.enable): key -> (TensorBoard tag, console field), None = not there.
_RUN_METRICS = {
    "replica_groups": ("fault_tolerance/replica_groups", "replica groups {:.0f}"),
    "params_checksum": (None, None),  # an integer: equal weights in every replica group at a step
}


def format_step_line(
    step: int,
    total_steps: int | None,
    values: dict[str, float],
    elapsed: float,
    eta: float | None,
    source_tokens: dict[str, int] | None = None,
) -> str:
    """The console line of a logged step, without an unknown MFU (NaN) or ETA."""
    fields = [f"step {step}/{total_steps} ({100 * step // total_steps}%)" if total_steps else f"step {step}"]
    for key, (_, field) in _METRICS.items():
        if key == "tflops" and values[key] >= 100:
            field = "tflops/rank {:.0f}"
        if key != "mfu" or math.isfinite(values[key]):
            fields.append(field.format(values[key]))
    fields += [field.format(values[key]) for key, (_, field) in _RUN_METRICS.items() if field and key in values]
    if source_tokens:
        fields.append("tokens " + ", ".join(f"{name} {count:,}" for name, count in source_tokens.items()))
    fields.append(f"elapsed {format_duration(elapsed)}")
    if eta is not None:
        fields.append(f"eta {format_duration(eta)}")
    return " | ".join(fields)


def format_stragglers(stragglers: list[dict]) -> str:
    """``stragglers rank 3 on node1 busy 2.41x its peers``: the console field of the ranks the watchdog names."""
    named = (f"rank {s['rank']} on {s['host']} busy {s['busy_ratio']:.2f}x its peers" for s in stragglers)
    return "stragglers " + ", ".join(named)


def format_summary(progress: RunProgress, tokens_per_step: int, folders: dict[str, str | None]) -> str:
    """Wall time, steps, global tokens, final and best loss, then ``folders`` (label -> path, or None)."""
    where = f"step {progress.last[0]}" if progress.last else f"step {progress.start_step}"
    total = f"/{progress.total_steps}" if progress.total_steps else ""
    resumed = f" (resumed from step {progress.start_step})" if progress.start_step else ""
    steps = "1 step" if progress.steps_run == 1 else f"{progress.steps_run} steps"
    tokens = progress.steps_run * tokens_per_step
    lines = [
        f"training finished at {where}{total}",
        f"  wall time   {format_duration(progress.elapsed())} for {steps}{resumed}",
        f"  tokens      {tokens:,} (global, {tokens_per_step:,} per step)",
    ]
    if progress.last is not None and progress.best is not None:
        (last_step, last_loss), (best_step, best_loss) = progress.last, progress.best
        lines.append(f"  loss        final {last_loss:.4f} (step {last_step}), best {best_loss:.4f} (step {best_step})")
    lines += [f"  {label:<11} {path}" for label, path in folders.items() if path]
    return "\n".join(lines)


def check_wandb() -> None:
    """ConfigError when this host cannot start W&B runs: no package, refused WANDB_* settings, no API key."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("metrics.enable_wandb: the wandb package is not installed here (pip install wandb)") from None
    try:
        # Read as wandb.init reads them: in the ranks a refused one is only a warning, and no W&B run.
        wandb.Settings().update_from_env_vars(dict(os.environ))
    except ValueError as e:  # pydantic's ValidationError
        raise ConfigError(f"metrics.enable_wandb: W&B refuses its WANDB_* settings ({_settings_problems(e)})") from None
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun", "disabled"):
        return
    silent = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"  # else the login looks the user up over the network
    try:
        wandb.login(verify=False)
    except wandb.errors.UsageError as e:
        raise ConfigError(f"metrics.enable_wandb: {e} (or set WANDB_MODE=offline to keep the run on disk)") from None
    finally:
        if silent is None:
            del os.environ["WANDB_SILENT"]
        else:
            os.environ["WANDB_SILENT"] = silent


def _settings_problems(error: ValueError) -> str:
    """Each refused setting of a pydantic ValidationError: ``mode='ofline': Input should be ...``."""
    if not hasattr(error, "errors"):
        return first_line(error)
    return "; ".join(
        f"{'.'.join(map(str, problem['loc']))}={problem.get('input')!r}: {problem['msg']}" for problem in error.errors()
    )


def _start_wandb(folder: str, settings: dict[str, Any]) -> Any:
    """A W&B run under ``folder``; None, with a warning, when W&B's side keeps it from starting."""
    import wandb

    os.makedirs(folder, exist_ok=True)
    try:
        # WANDB_TEAM is torchtitan's name for the entity; wandb reads its other WANDB_* itself.
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "tessera"),
            entity=os.environ.get("WANDB_TEAM"),
            dir=folder,
            **settings,
        )
    except Exception as e:  # noqa: BLE001 - whatever W&B raises, training must not stop for it
        logger.warning("metrics.enable_wandb: no W&B run (%s); the metrics go to the other logs", e)
        return None
    logger.info("W&B run %s", _wandb_location(run))
    return run


def _wandb_location(run: Any) -> str:
    return run.url or os.path.dirname(run.dir)  # offline, the folder (run.dir is its files/)


def _json_number(value: float) -> float | None:
    # Strict JSON has no NaN/Infinity; null keeps each line parseable by any tool.
    return value if math.isfinite(value) else None


def _name_aside(stem: str, last_write: float, extension: str = "") -> str:
    """A free name for an earlier run's records: ``stem.<time of their last write>extension``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(last_write))
    return free_path(f"{stem}.{stamp}", extension)  # two runs may have ended in the same second


def _move_aside(path: str) -> None:
    """Renames an earlier run's records at ``path``, whose steps would interleave with this one's."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    stem, extension = os.path.splitext(path)
    moved = _name_aside(stem, os.path.getmtime(path), extension)
    os.replace(path, moved)
    logger.warning("%s holds an earlier run's records; moved to %s (this run starts from step 0)", path, moved)


def _move_events_aside(folder: str, events: list[str]) -> None:
    """Moves an earlier run's TensorBoard events (drawn as one curve with this one's) beside ``folder``."""
    moved = _name_aside(folder.rstrip(os.sep), max(os.path.getmtime(path) for path in events))
    os.makedirs(moved)
    for path in events:
        os.replace(path, os.path.join(moved, os.path.basename(path)))
    logger.warning("%s holds an earlier run's TensorBoard events; moved to %s", folder, moved)


class MetricsLogger:
    """Per-step metrics to the console, ``metrics.jsonl``, TensorBoard and W&B, and the run's summary;
    built on every rank, each writing what it is enabled for. ``start`` comes before ``log``."""

    def __init__(
        self,
        dump_folder: str,
        *,
        enable: bool,
        enable_tensorboard: bool,
        tensorboard_dir: str,
        wandb_run: dict[str, Any] | None = None,
        total_steps: int | None = None,
        tokens_per_step: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enable
        self.progress = RunProgress(total_steps, clock=clock)
        self.tokens_per_step = tokens_per_step
        self.tensorboard_dir = tensorboard_dir if enable_tensorboard else None
        self._jsonl = None
        self._tensorboard: Any = None  # SummaryWriter; imported lazily, it pulls in tensorboard
        events = os.path.join(glob.escape(tensorboard_dir), "events.out.tfevents.*")
        self._earlier_events = sorted(glob.glob(events)) if enable_tensorboard else []
        if enable:
            os.makedirs(dump_folder, exist_ok=True)
            self.jsonl_path = os.path.join(dump_folder, METRICS_FILE)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._wandb = _start_wandb(dump_folder, wandb_run) if wandb_run is not None else None

    def start(self, step: int, new_run: bool = False) -> None:
        """Training starts after ``step``. A ``new_run`` (from step 0, not restarted) first moves an
        earlier run's records in its folders aside; a restart or a resumed run appends."""
        self.progress.start(step)
        if self._earlier_events and new_run:
            _move_events_aside(self.tensorboard_dir, self._earlier_events)
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # A resume purges the earlier attempts' events from its first step on: one point per step.
            self._tensorboard = SummaryWriter(self.tensorboard_dir, purge_step=step + 1 if step else None)
            logger.info("TensorBoard logs in %s", self.tensorboard_dir)
        if self._jsonl is not None and new_run:
            self._jsonl.close()
            for name in (METRICS_FILE, VALIDATION_FILE, EVALUATION_FILE):
                _move_aside(os.path.join(os.path.dirname(self.jsonl_path), name))
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")

    def step_done(self, step: int, loss: float) -> None:
        """Every completed step, logged or not: the ETA and the summary."""
        self.progress.step_done(step, loss)

    def log(
        self,
        step: int,
        metrics: dict[str, float],
        source_tokens: dict[str, int] | None = None,
        stragglers: list[dict] | None = None,
    ) -> None:
        """``source_tokens``: the global trained labels of each source (by name) since the last log;
        ``stragglers``: the ranks the watchdog names (None when metrics.straggler_threshold is 0)."""
        if not self.enabled and self._tensorboard is None and self._wandb is None:
            return
        values = {key: float(metrics[key]) for key in _METRICS}
        values |= {key: metrics[key] for key in _RUN_METRICS if key in metrics}
        if self.enabled:
            elapsed = self.progress.elapsed()
            eta = self.progress.eta()
            line = format_step_line(step, self.progress.total_steps, values, elapsed, eta, source_tokens)
            logger.info("%s", f"{line} | {format_stragglers(stragglers)}" if stragglers else line)
            record = {"step": step} | {key: _json_number(value) for key, value in values.items()}
            if source_tokens:
                record["tokens_per_source"] = source_tokens
            if stragglers is not None:
                record["stragglers"] = stragglers
            self._jsonl.write(json.dumps(record | {"elapsed_s": round(elapsed, 3)}) + "\n")
            self._jsonl.flush()  # a crash must not lose the lines before it

        # No MFU point when the peak is unknown.
        scalars = {tag: values[key] for key, (tag, _) in _METRICS.items() if math.isfinite(values[key]) or key != "mfu"}
        scalars.update({tag: values[key] for key, (tag, _) in _RUN_METRICS.items() if tag and key in values})
        scalars.update({f"tokens_per_source/{name}": count for name, count in (source_tokens or {}).items()})
        if stragglers is not None:
            scalars["stragglers/count"] = len(stragglers)
            scalars.update({f"stragglers/rank_{s['rank']}_busy_ratio": s["busy_ratio"] for s in stragglers})
        self._scalars(step, scalars)

    def summary(self, *, checkpoint_folder: str | None = None, hf_folder: str | None = None) -> None:
        if not self.enabled:
            return
        folders = {
            "metrics": self.jsonl_path,
            "tensorboard": self.tensorboard_dir,
            "wandb": self._wandb and _wandb_location(self._wandb),
            "checkpoints": checkpoint_folder,
            "hf export": hf_folder,
        }
        logger.info("%s", format_summary(self.progress, self.tokens_per_step, folders))

    def log_validation(self, step: int, loss: float) -> None:
        if self.enabled:
            logger.info("step %d | validation loss %.4f", step, loss)
            self._append(VALIDATION_FILE, {"step": step, "loss": _json_number(loss)})
        self._scalars(step, {"validation/loss": loss})

    def log_evaluation(self, step: int, tasks: dict[str, dict[str, float]], seconds: float) -> None:
        """Each task's scores (trainer/evaluate.py: acc and acc_norm, or exact_match), and the seconds the
        evaluation took."""
        if self.enabled:
            scores = " | ".join(
                f"{name} " + " ".join(f"{key} {value:.4f}" for key, value in v.items()) for name, v in tasks.items()
            )
            logger.info("step %d | eval %s | %.2fs", step, scores, seconds)
            self._append(EVALUATION_FILE, {"step": step, "tasks": tasks, "seconds": round(seconds, 3)})
        self._scalars(step, {f"eval/{name}/{key}": value for name, v in tasks.items() for key, value in v.items()})

    def _append(self, name: str, record: dict) -> None:
        with open(os.path.join(os.path.dirname(self.jsonl_path), name), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _scalars(self, step: int, scalars: dict[str, float]) -> None:
        """To TensorBoard and W&B, where enabled."""
        if self._tensorboard is not None:
            for tag, value in scalars.items():
                self._tensorboard.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self.enabled = False


def build_metrics_logger(config: JobConfig, rank: int, tokens_per_step: int) -> MetricsLogger:
    """Rank 0 logs; with metrics.save_for_all_ranks every rank writes TensorBoard (and W&B) of its own."""
    job, metrics = config.job, config.metrics
    run_name = [job.run_name or time.strftime("%Y%m%d-%H%M%S")]
    every_rank = metrics.save_for_all_ranks
    if every_rank and not job.run_name:
        dist.broadcast_object_list(run_name, src=0)  # the ranks' clocks may cross a second
    name = run_name[0]
    tensorboard_dir = os.path.join(job.dump_folder, metrics.save_tb_folder, name)
    wandb_run = None
    if metrics.enable_wandb and (rank == 0 or every_rank):
        wandb_run = {"name": name, "config": dataclasses.asdict(config)}
        if every_rank:
            wandb_run.update(name=f"{name}-rank_{rank}", group=name)
    return MetricsLogger(
        job.dump_folder,
        enable=rank == 0,
        enable_tensorboard=metrics.enable_tensorboard and (rank == 0 or every_rank),
        tensorboard_dir=os.path.join(tensorboard_dir, f"rank_{rank}") if every_rank else tensorboard_dir,
        wandb_run=wandb_run,
        total_steps=config.training.steps,
        tokens_per_step=tokens_per_step,
    )

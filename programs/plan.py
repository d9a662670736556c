"""Layout planner: ranks the layouts of a model on ``plan.devices`` by an estimated step time,
measures the fastest with the dry run until ``plan.top`` fit, and writes the best as a config file
(docs/dry-run-and-planner.md)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass

import torch

from config.errors import ConfigError, print_error, user_input
from config.job_config import JobConfig
from config.manager import help_text, load_config, named_as_given, to_toml
from models.registry import get_model_spec
from models.sizes import architecture_folder, job_model_args
from parallelisms.pipeline import plan_pipeline
from programs.dry_run import dry_run, in_child, measured_ranks
from programs.time_model import MICROBATCHES, Layout, ModelShape, Rates, read_calibration, step_seconds

GiB = 2**30
AC_MODES = ("none", "selective", "full")
SCHEDULES = ("1F1B", "Interleaved1F1B")


def model_shape(config: JobConfig) -> ModelShape:
    """Parameter counts of the job's model, from modules built on the meta device."""
    args = job_model_args(config)
    found = architecture_folder(config)
    name = config.model.flavor if found is None else found[1]
    cls = get_model_spec(config.model.name).model_cls
    with torch.device("meta"):
        one, two = (sum(p.numel() for p in cls(dataclasses.replace(args, n_layers=n)).parameters()) for n in (1, 2))
    kv_heads = args.n_kv_heads or args.n_heads
    return ModelShape(name, args.n_layers, args.dim, args.vocab_size, args.n_heads, kv_heads, two - one, 2 * one - two)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def global_batch(config: JobConfig) -> int:
    """Sequences per step: training.global_batch_size, or one local batch per device when unset."""
    t = config.training
    return t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * config.plan.devices


def _pipelines(config: JobConfig, shape: ModelShape, pp: int, per_rank: int):
    """(schedule, stages, largest stage's blocks, microbatch, local batch) of each pipeline tried."""
    if pp == 1:
        yield from (("", 1, shape.n_layers, mb, mb) for mb in MICROBATCHES if per_rank % mb == 0)
        return
    for schedule in SCHEDULES:
        for mb in MICROBATCHES:
            if per_rank % mb:
                continue
            # The most microbatches per pipeline step up to 4 per stage: a smaller bubble.
            n_mb = max(d for d in _divisors(per_rank // mb) if d <= 4 * pp)
            try:
                layout = plan_pipeline(
                    n_layers=shape.n_layers,
                    pp_degree=pp,
                    schedule=schedule,
                    layers_per_stage=None,
                    split_points=(),
                    local_batch_size=n_mb * mb,
                    microbatch_size=mb,
                    first_stage_less_layers=config.parallelism.pipeline_parallel_first_stage_less_layers,
                    last_stage_less_layers=config.parallelism.pipeline_parallel_last_stage_less_layers,
                )
            except ValueError:
                continue  # the blocks or microbatches do not split for this schedule
            yield schedule, layout.num_stages, max(map(len, layout.stage_layers)), mb, n_mb * mb


def enumerate_layouts(config: JobConfig, shape: ModelShape) -> list[Layout]:
    plan, batch = config.plan, global_batch(config)
    layouts = []
    for tp in _divisors(plan.devices):
        if tp > plan.devices_per_node or shape.n_heads % tp or shape.n_kv_heads % tp:
            continue  # tensor parallelism stays inside a node and splits whole heads
        for pp in (d for d in _divisors(plan.devices // tp) if d in (1, 2, 4, 8, 16) and d <= shape.n_layers):
            dp = plan.devices // (tp * pp)
            if batch % dp:
                continue
            node_shard = max(1, plan.devices_per_node // tp)  # HSDP: shard inside a node, replicate across
            replicates = {1, dp} | ({dp // node_shard} if node_shard < dp and dp % node_shard == 0 else set())
            for pipeline in _pipelines(config, shape, pp, batch // dp):
                for replicate in sorted(replicates):
                    for impl in ("fsdp2", "simple_fsdp"):
                        for ac in plan.activation_checkpoint_modes:
                            layouts.append(Layout(impl, replicate, dp // replicate, tp, pp, *pipeline, ac))
    return layouts


def layout_config(config: JobConfig, layout: Layout) -> JobConfig:
    """``config`` laid out as ``layout``, computing in bf16 as on GPUs."""
    parallelism = dataclasses.replace(
        config.parallelism,
        data_parallel_impl=layout.impl,
        data_parallel_replicate_degree=layout.replicate,
        data_parallel_shard_degree=layout.shard,
        tensor_parallel_degree=layout.tp,
        pipeline_parallel_degree=layout.pp,
        pipeline_parallel_schedule=layout.schedule or config.parallelism.pipeline_parallel_schedule,
        pipeline_parallel_microbatch_size=layout.microbatch,
        # The planner plans the default split (one stage per rank, two for multi-stage schedules).
        pipeline_parallel_layers_per_stage=None,
        pipeline_parallel_split_points=[],
        module_fqns_per_model_part=[],
    )
    training = dataclasses.replace(
        config.training,
        local_batch_size=layout.local_batch,
        global_batch_size=global_batch(config),
        mixed_precision_param="bfloat16",
        enable_cpu_offload=layout.offload,
    )
    return dataclasses.replace(
        config,
        parallelism=parallelism,
        training=training,
        # The time model's selective is the op-level policy (every second matmul recomputed).
        activation_checkpoint=dataclasses.replace(
            config.activation_checkpoint,
            mode=layout.ac,
            selective_ac_option="op" if layout.ac == "selective" else config.activation_checkpoint.selective_ac_option,
        ),
        # Compiled: SimpleFSDP's bucketing, which the time model counts on, is a compiler pass.
        compile=dataclasses.replace(
            config.compile, enable=True, components=["model", "loss"], bucketing="manual", manual_buckets=[]
        ),
    )


def _peak_of(config: JobConfig, world_size: int, rank: int) -> tuple[int, int]:
    """``rank``'s eager peak in the dry run, and the gathered bytes compiled SimpleFSDP's buckets add to it."""
    logging.disable(logging.WARNING)  # the build's warnings, once per dry run; the planner says what matters
    report = dry_run(config, world_size, rank)
    return report.peak_bytes, report.bucket_pair_bytes


class PeakEstimator:
    """Per-rank peak bytes by the dry run on 1 and 2 blocks per stage, extrapolated linearly to the
    model's; cached by shape (HSDP's replicas change no rank's memory: measured with one)."""

    def __init__(self, config: JobConfig, shape: ModelShape):
        self.config, self.shape = config, shape
        self.cache: dict[tuple, tuple[int, int]] = {}
        self.dry_runs, self.seconds = 0, 0.0

    def _measure(self, layout: Layout, blocks: int) -> tuple[int, int]:
        key = (dataclasses.replace(layout, replicate=1), blocks)
        if key not in self.cache:
            config = layout_config(self.config, key[0])
            config = dataclasses.replace(
                config,
                model=dataclasses.replace(config.model, n_layers=layout.stages * blocks),
                parallelism=dataclasses.replace(
                    config.parallelism,
                    pipeline_parallel_split_points=[f"layers.{blocks * s}" for s in range(1, layout.stages)],
                ),
                # One microbatch per step: accumulating more changes no peak (gradients sum in place).
                training=dataclasses.replace(config.training, global_batch_size=-1),
            )
            start = time.perf_counter()
            world_size = layout.shard * layout.tp * layout.pp
            ranks = measured_ranks(config, world_size)
            # The larger peak: rank 0's, or the last pipeline stage's (the logits and the loss).
            self.cache[key] = max(in_child(_peak_of, config, world_size, rank) for rank in ranks)
            self.dry_runs += len(ranks)
            self.seconds += time.perf_counter() - start
        return self.cache[key]

    def peak_bytes(self, layout: Layout) -> int:
        blocks = layout.stage_blocks
        (one, one_buckets), (two, two_buckets) = self._measure(layout, 1), self._measure(layout, 2)
        # Compiled SimpleFSDP's two largest neighbouring buckets are the same from 2 blocks on.
        return one + (blocks - 1) * (two - one) + (one_buckets if blocks == 1 else two_buckets)


def state_bytes_floor(shape: ModelShape, layout: Layout) -> float:
    """A lower bound of the device's peak: fp32 weights, gradients and Adam moments, 16 bytes per
    parameter (none when offloaded)."""
    return 0.0 if layout.offload else host_state_bytes(shape, layout)


def host_state_bytes(shape: ModelShape, layout: Layout) -> float:
    """One device's fp32 weights, gradients and Adam moments: what CPU offload keeps in host memory."""
    params = shape.block_params * shape.n_layers + shape.other_params
    return 16 * params / (layout.shard * layout.tp * layout.pp)


@dataclass
class Planned:
    layout: Layout
    peak_bytes: int
    step_seconds: float


def _needs_more(layout: Layout, than: Layout) -> bool:
    """Whether ``layout`` is ``than`` with more sequences per microbatch or less recomputation."""
    same = dataclasses.replace(layout, microbatch=than.microbatch, local_batch=than.local_batch, ac=than.ac) == than
    more = layout.microbatch >= than.microbatch and AC_MODES.index(layout.ac) <= AC_MODES.index(than.ac)
    return same and more


def plan_layouts(
    config: JobConfig, shape: ModelShape, estimator: PeakEstimator, rates: Rates
) -> tuple[list[Planned], int]:
    """The fastest ``plan.top`` layouts that fit and the number tried; ConfigError when none fits.
    Only when none fits are the sharded layouts tried again with CPU offload, whose state must fit
    ``plan.host_memory_gib`` per node."""
    plan = config.plan
    layouts = enumerate_layouts(config, shape)
    if not layouts:
        raise ConfigError(f"plan.devices: no layout of {shape.name} splits {plan.devices} devices and the batch")
    fitting, measured = _fitting(config, shape, estimator, layouts, rates)
    if fitting:
        return fitting, len(layouts)
    node_devices = min(plan.devices, plan.devices_per_node)
    offloaded = [
        dataclasses.replace(lay, offload=True)
        for lay in layouts
        if lay.shard > 1 and host_state_bytes(shape, lay) * node_devices <= plan.host_memory_gib * GiB
    ]
    fitting, _ = _fitting(config, shape, estimator, offloaded, rates)
    if fitting:
        return fitting, len(layouts) + len(offloaded)
    if not measured:
        # Even the weights' state does not fit: measure the layout that shards it most, saving most.
        smallest = min(
            layouts, key=lambda lay: (state_bytes_floor(shape, lay), -AC_MODES.index(lay.ac), lay.microbatch)
        )
        measured.append((estimator.peak_bytes(smallest), smallest))
    peak, layout = min(measured, key=lambda m: m[0])
    raise ConfigError(
        f"no layout of {shape.name} fits {plan.devices} devices of {plan.device_memory_gib:g} GiB: "
        f"the smallest peak is {peak / GiB:.2f} GiB ({layout.describe()}); nor with CPU offload "
        f"({len(offloaded)} layouts whose state fits plan.host_memory_gib {plan.host_memory_gib:g} per node)"
    )


def _fitting(
    config: JobConfig, shape: ModelShape, estimator: PeakEstimator, layouts: list[Layout], rates: Rates
) -> tuple[list[Planned], list[tuple[int, Layout]]]:
    """The fastest ``plan.top`` of ``layouts`` that fit, and the (peak, layout) of those measured."""
    plan = config.plan
    limit = plan.device_memory_gib * GiB

    def seconds(layout: Layout) -> float:
        return step_seconds(rates, layout, global_batch(config))

    timed = sorted(layouts, key=lambda lay: (seconds(lay), AC_MODES.index(lay.ac)))
    fitting, measured = [], []
    frugal = max(plan.activation_checkpoint_modes, key=AC_MODES.index)

    def fits(layout: Layout) -> int | None:
        if state_bytes_floor(shape, layout) > limit or any(
            _needs_more(layout, lay) for peak, lay in measured if peak > limit
        ):
            return None
        if len(measured) == plan.max_measured:
            return None
        try:
            peak = estimator.peak_bytes(layout)
        except ConfigError:
            return None  # a layout the real run refuses (e.g. a pipeline split it cannot make)
        measured.append((peak, layout))
        return peak if peak <= limit else None

    for layout in timed:
        if len(fitting) == plan.top or len(measured) == plan.max_measured:
            break
        # The same layout recomputing the most goes first: when it does not fit, none of its kind does.
        if layout.ac != frugal and fits(dataclasses.replace(layout, ac=frugal)) is None:
            continue
        if (peak := fits(layout)) is not None:
            fitting.append(Planned(layout, peak, seconds(layout)))
    # Measured recomputing more than the fastest layouts, some may fit that the time order has not reached.
    fitting = sorted(
        (Planned(lay, peak, seconds(lay)) for peak, lay in measured if peak <= limit),
        key=lambda p: p.step_seconds,
    )[: plan.top]
    return fitting, measured


def table(config: JobConfig, planned: list[Planned]) -> str:
    tokens = global_batch(config) * config.training.seq_len
    rows = [f"{'#':>2}  {'layout':<58} {'peak GiB':>9} {'step s':>8} {'tokens/s/device':>16}"]
    for i, p in enumerate(planned, 1):
        rate = tokens / p.step_seconds / config.plan.devices
        rows.append(
            f"{i:>2}  {p.layout.describe():<58} {p.peak_bytes / GiB:>9.2f} {p.step_seconds:>8.2f} {rate:>16,.0f}"
        )
    return "\n".join(rows)


def _rates_source(rates: Rates) -> str:
    plan = rates.config.plan
    if rates.calibration is not None:
        return f"compute and collectives as measured in {plan.calibration_file}"
    return f"{plan.mfu:g} MFU of {plan.peak_tflops:g} TFLOP/s and the [plan] link figures"


def check_plan(config: JobConfig) -> None:
    plan = config.plan
    unknown = [mode for mode in plan.activation_checkpoint_modes if mode not in AC_MODES]
    if unknown or not plan.activation_checkpoint_modes:
        raise ConfigError(f"plan.activation_checkpoint_modes: {unknown or 'empty'}; choose from {', '.join(AC_MODES)}")
    for key in ("devices", "devices_per_node", "top", "max_measured"):
        if getattr(plan, key) < 1:
            raise ConfigError(f"plan.{key} must be >= 1, got {getattr(plan, key)}")
    for key in (
        "device_memory_gib",
        "host_memory_gib",
        "host_link_gbps",
        "peak_tflops",
        "intra_node_gbps",
        "inter_node_gbps",
    ):
        if getattr(plan, key) <= 0:
            raise ConfigError(f"plan.{key} must be positive, got {getattr(plan, key)}")
    if not 0 < plan.mfu <= 1:
        raise ConfigError(f"plan.mfu must be in (0, 1], got {plan.mfu}")
    if plan.link_latency_us < 0:
        raise ConfigError(f"plan.link_latency_us must be >= 0, got {plan.link_latency_us}")


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text("python -m programs.plan"))
        return 0
    start = time.perf_counter()
    try:
        config = load_config(argv)
        check_plan(config)
        with user_input():
            shape = model_shape(config)
        estimator = PeakEstimator(config, shape)
        calibration = read_calibration(config.plan.calibration_file) if config.plan.calibration_file else None
        rates = Rates(config, shape, calibration)
        planned, tried = plan_layouts(config, shape, estimator, rates)
        best = layout_config(config, planned[0].layout)
        # The written file is read as --job.config_file itself: it names no other.
        best = dataclasses.replace(best, job=dataclasses.replace(best.job, config_file=""))
        with user_input("plan.output"), open(config.plan.output, "w") as f:
            f.write(to_toml(best))
    except ConfigError as e:
        print_error(named_as_given(e, argv))
        return 2
    plan = config.plan
    print(
        f"plan: {shape.name} on {plan.devices} devices of {plan.device_memory_gib:g} GiB, "
        f"{global_batch(config)} x {config.training.seq_len} tokens per step; {tried} layouts, "
        f"{len(estimator.cache) // 2} measured ({estimator.dry_runs} dry runs in {estimator.seconds:.0f}s), "
        f"{time.perf_counter() - start:.0f}s in all"
    )
    print(table(config, planned))
    print(
        "peak: the dry run's per-rank peak, measured on 1 and 2 blocks per stage, extrapolated; "
        f"step: {_rates_source(rates)}, plus the communication compute does not hide (docs/dry-run-and-planner.md)"
    )
    print(f"wrote the best layout to {plan.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

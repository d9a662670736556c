"""The layout planner's time model: one step's seconds for a layout, from rates given as ``[plan]``
figures or measured on the target machine (``plan.calibration_file``, written by
``python -m programs.calibrate``). docs/dry-run-and-planner.md describes it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from config.errors import ConfigError, user_input
from config.job_config import JobConfig
from parallelisms.cost_model import wire_bytes

# Extra block work of each AC mode, of forward + backward: full recomputes the forward (1 of 3),
# selective (every second matmul) half of it.
RECOMPUTE = {"none": 0.0, "selective": 1 / 6, "full": 1 / 3}
# DDP's gradient buckets (torch's default bucket_cap_mb), one all-reduce each.
DDP_BUCKET_BYTES = 25 * 2**20
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send")
# Sequences per microbatch the planner tries and the calibration measures: those a user tries, up to
# torchtitan's debug config's 8.
MICROBATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Layout:
    impl: str
    replicate: int
    shard: int
    tp: int
    pp: int
    schedule: str  # empty without pipelining
    stages: int  # pipeline stages in all
    stage_blocks: int  # of the largest stage
    microbatch: int  # sequences per forward (a pipeline microbatch or a gradient-accumulation step)
    local_batch: int  # training.local_batch_size: one microbatch, or a pipeline step's
    ac: str
    offload: bool = False  # training.enable_cpu_offload: tried only when no layout fits without

    def describe(self) -> str:
        if self.shard == 1 and self.replicate > 1:
            mesh = f"ddp {self.replicate}"
        else:
            mesh = "dp " + (f"{self.replicate}x{self.shard}" if self.replicate > 1 else f"{self.shard}")
        pipe = f" pp{self.pp} {self.schedule} ({self.local_batch // self.microbatch} mb)" if self.pp > 1 else ""
        offload = " cpu offload" if self.offload else ""
        return f"{self.impl} {mesh} tp{self.tp}{pipe} mbs {self.microbatch} ac {self.ac}{offload}"


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    dim: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    block_params: int
    other_params: int  # embedding, final norm and output head


@dataclass(frozen=True)
class Calibration:
    """Rates measured on the target machine: seconds of one block's and of the rest of the model's
    forward and backward at each measured microbatch, each collective's latency and bus bandwidth,
    and the fraction of a collective that hides behind compute."""

    microbatches: tuple[int, ...]
    block_seconds: tuple[float, ...]
    rest_seconds: tuple[float, ...]
    links: dict[str, tuple[float, float]]  # kind -> (seconds per call, bytes per second)
    overlap: float
    param_bytes: int  # of one gathered parameter in the measured precision

    def pass_seconds(self, seconds: tuple[float, ...], microbatch: float) -> float:
        """Interpolated in the microbatch, extrapolated linearly past the measured ones (a tensor-parallel
        rank's share of a microbatch is a fraction of one)."""
        xs, ys = self.microbatches, seconds
        i = max(1, min(len(xs) - 1, sum(x < microbatch for x in xs)))
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (microbatch - x0) / (x1 - x0))

    def collective_seconds(self, kind: str, group: int, nbytes: float, calls: float) -> float:
        if group == 1:
            return 0.0
        alpha, bandwidth = self.links[kind]
        # The bytes the calibration's fit priced: the same convention for the same kind.
        return calls * alpha + wire_bytes(kind, nbytes, group) / bandwidth


def read_calibration(path: str) -> Calibration:
    """The calibration file at ``path``; ConfigError naming plan.calibration_file when it is not one."""
    with user_input("plan.calibration_file"), open(path, encoding="utf-8") as f:
        data = json.load(f)
    try:
        compute, links = data["compute"], data["collectives"]
        if links is None:
            raise ConfigError(
                f"plan.calibration_file: {path} was measured on one rank: it has no collectives "
                "(calibrate on 2 or more)"
            )
        return Calibration(
            microbatches=tuple(compute["microbatches"]),
            block_seconds=tuple(compute["block_seconds"]),
            rest_seconds=tuple(compute["rest_seconds"]),
            links={kind: (links[kind]["alpha_us"] * 1e-6, links[kind]["gbps"] * 1e9) for kind in KINDS},
            overlap=float(data["overlap"]),
            param_bytes=2 if data["dtype"] == "bfloat16" else 4,
        )
    except (KeyError, TypeError) as e:
        raise ConfigError(f"plan.calibration_file: {path} is not a calibration file (no {e})") from None


def _ring_seconds(plan, group: int, span: int, nbytes: float, collectives: float) -> float:
    """A ring collective over ``group`` ranks within ``span`` consecutive ones moving ``nbytes`` in
    ``collectives`` calls: (group - 1) hops of latency per call, (group - 1) / group of the bytes."""
    if group == 1:
        return 0.0
    gbps = plan.intra_node_gbps if span <= plan.devices_per_node else plan.inter_node_gbps
    return collectives * (group - 1) * plan.link_latency_us * 1e-6 + (group - 1) / group * nbytes / (gbps * 1e9)


class Rates:
    """What the time model prices with: the ``[plan]`` figures (FLOPs at peak_tflops x mfu, rings at
    the node's link figures, collectives hidden behind compute as far as it lasts), or a calibration."""

    def __init__(self, config: JobConfig, shape: ModelShape, calibration: Calibration | None = None):
        self.config, self.shape, self.calibration = config, shape, calibration
        self.param_bytes = calibration.param_bytes if calibration else 2
        self.overlap = calibration.overlap if calibration else 1.0

    def block_seconds(self, microbatch: float) -> float:
        """One block's forward and backward over ``microbatch`` sequences (a TP rank's share: a fraction)."""
        if self.calibration:
            return self.calibration.pass_seconds(self.calibration.block_seconds, microbatch)
        seq, shape = self.config.training.seq_len, self.shape
        return (6 * shape.block_params + 12 * shape.dim * seq) * microbatch * seq / self._flops_per_second()

    def rest_seconds(self, microbatch: float) -> float:
        """The embedding, final norm, output and loss's forward and backward."""
        if self.calibration:
            return self.calibration.pass_seconds(self.calibration.rest_seconds, microbatch)
        return 6 * self.shape.other_params * microbatch * self.config.training.seq_len / self._flops_per_second()

    def _flops_per_second(self) -> float:
        return self.config.plan.peak_tflops * 1e12 * self.config.plan.mfu

    def collective(self, kind: str, group: int, span: int, nbytes: float, calls: float) -> float:
        """``calls`` collectives of ``kind`` over ``group`` ranks (within ``span`` consecutive ones) moving ``nbytes``."""
        if self.calibration:
            return self.calibration.collective_seconds(kind, group, nbytes, calls)
        plan = self.config.plan
        if kind == "send":
            gbps = plan.intra_node_gbps if plan.devices <= plan.devices_per_node else plan.inter_node_gbps
            return calls * plan.link_latency_us * 1e-6 + nbytes / (gbps * 1e9) if group > 1 else 0.0
        ring = _ring_seconds(plan, group, span, nbytes, calls)
        return 2 * ring if kind == "all_reduce" else ring


def step_seconds(rates: Rates, layout: Layout, global_batch: int) -> float:
    """Compute with the pipeline bubble, plus the communication compute does not hide."""
    config, shape, lay = rates.config, rates.shape, layout
    seq = config.training.seq_len
    dp = lay.replicate * lay.shard
    passes = global_batch // dp // lay.local_batch  # gradient-accumulation steps
    microbatches = lay.local_batch // lay.microbatch
    blocks = shape.n_layers / lay.pp
    # The slowest stage (the last: blocks, output and loss) per microbatch; a TP rank computes its share.
    share = lay.microbatch / lay.tp
    stage = blocks * rates.block_seconds(share) * (1 + RECOMPUTE[lay.ac]) + rates.rest_seconds(share) / lay.pp
    compute = passes * microbatches * stage
    if lay.pp > 1:
        compute *= 1 + (lay.pp - 1) / (lay.stages // lay.pp * microbatches)
    exposed = _data_parallel_exposed(rates, lay, passes, compute)
    # Sequence parallel: 4 activation all-gathers and 4 reduce-scatters per block and microbatch, exposed.
    activation = lay.microbatch * seq * shape.dim * rates.param_bytes
    calls = 4 * blocks * microbatches * passes
    tp = sum(rates.collective(kind, lay.tp, lay.tp, activation * calls, calls) for kind in KINDS[:2])
    # Pipeline: a send forward and one backward per stage boundary and microbatch, exposed.
    sends = 2 * (lay.stages // lay.pp) * microbatches * passes if lay.pp > 1 else 0
    pp = rates.collective("send", lay.pp, lay.pp, sends * activation / lay.tp, sends)
    return compute + exposed + tp + pp


def _data_parallel_exposed(rates: Rates, lay: Layout, passes: int, compute: float) -> float:
    """The data-parallel collectives compute does not hide: all-gathers (once per pipeline step),
    fp32 reduce-scatters and all-reduces, CPU offload's copies, and each pass's first gather."""
    shape, plan = rates.shape, rates.config.plan
    rank_params = (shape.block_params * shape.n_layers + shape.other_params) / (lay.tp * lay.pp)
    gathers = 1 if lay.pp > 1 else 2
    embedding = shape.vocab * shape.dim
    if lay.impl == "fsdp2":
        # One unit per block, and the root: embedding, final norm and output, gathered first.
        calls, first = shape.n_layers / lay.pp + 1, shape.other_params
    else:
        # Manual buckets: one per block, the embedding (gathered first), and final norm with output.
        calls, first = shape.n_layers / lay.pp + 2, embedding
    if lay.pp > 1:
        first = min(first, embedding)  # rank 0's first stage holds the embedding, not the output
    span = lay.shard * lay.tp
    ag = rates.collective("all_gather", lay.shard, span, rank_params * rates.param_bytes, calls)
    rs = rates.collective("reduce_scatter", lay.shard, span, rank_params * 4, calls)
    # HSDP all-reduces each unit's shard; DDP (no sharding) its whole gradient in buckets.
    ar_calls = math.ceil(rank_params * 4 / DDP_BUCKET_BYTES) if lay.shard == 1 else calls
    replicas = span * lay.replicate
    ar = rates.collective("all_reduce", lay.replicate, replicas, rank_params * 4 / lay.shard, ar_calls)
    dp_comm = passes * (gathers * ag + rs) + ar
    if lay.offload:
        # Each gather copies the fp32 shard to the device and each reduction its gradient back, over
        # the host link, overlapped as the collectives are. The host optimizer step is not priced.
        dp_comm += passes * (gathers + 1) * rank_params / lay.shard * 4 / (plan.host_link_gbps * 1e9)
    # The overlap's share hides behind compute while compute lasts; each pass waits for its first gather.
    hidden = min(rates.overlap * dp_comm, compute)
    first_gather = rates.collective("all_gather", lay.shard, span, first / lay.tp * rates.param_bytes, 1)
    return dp_comm - hidden + passes * first_gather

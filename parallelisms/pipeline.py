"""Pipeline parallelism: the transformer blocks split into stages that a
``torch.distributed.pipelining`` schedule runs microbatch by microbatch.

A stage is a copy of the whole model (on the meta device) without the other stages' blocks; the
first keeps ``tok_embeddings``, the last ``norm`` and ``output``. Names stay the full model's, so
seeded initialization, the parallelisms and checkpoints see the same names as without pipelining
(``layers`` is a ``ModuleDict`` keyed by the global block index; the other modules may be None).
A split that does not fit the schedule is refused, never silently rebalanced.

The caller's loss is a microbatch's summed loss over the global batch's token count, so summing
over microbatches already gives the global mean: gradients are left unscaled (``scale_grads``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class

from parallelisms.pipeline_csv import build_csv_schedule, read_schedule_csv

# Schedules that split backward into input and weight gradients (no compile, no FSDP reshard).
ZERO_BUBBLE_SCHEDULES = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})
# Schedules placing exactly two stages per rank in a V: rank r runs stages r and 2 pp - 1 - r.
V_SCHEDULES = frozenset({"ZBVZeroBubble"})

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


@dataclass(frozen=True)
class PipelineLayout:
    """Where the blocks go: the stages, the ranks running them, and the microbatch count."""

    schedule: str
    pp_degree: int
    stage_layers: tuple[tuple[int, ...], ...]  # global block indices of each stage
    n_microbatches: int
    schedule_csv: str = ""  # a custom order of actions (parallelisms/pipeline_csv.py)
    stage_ranks: tuple[int, ...] = ()  # the rank of each stage, when the CSV places them

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The stages that ``pp_rank`` runs, in the order the schedule expects them."""
        if self.stage_ranks:
            return [s for s, rank in enumerate(self.stage_ranks) if rank == pp_rank]
        if self.schedule in V_SCHEDULES:
            return [pp_rank, self.num_stages - 1 - pp_rank]
        return list(range(pp_rank, self.num_stages, self.pp_degree))

    def describe(self) -> str:
        """One line per rank: its stages and their blocks."""
        return "\n".join(
            f"  pp rank {rank}: "
            + ", ".join(f"stage {s} = layers {list(self.stage_layers[s])}" for s in self.stage_indices(rank))
            for rank in range(self.pp_degree)
        )


def plan_pipeline(
    *,
    n_layers: int,
    pp_degree: int,
    schedule: str,
    layers_per_stage: int | None,
    split_points: Sequence[str],
    local_batch_size: int,
    microbatch_size: int,
    module_fqns: Sequence[Sequence[str]] = (),
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
    schedule_csv: str = "",
) -> PipelineLayout:
    """Splits ``n_layers`` blocks into stages for ``schedule`` on ``pp_degree`` ranks, at
    ``split_points`` (``'layers.N'`` starts a stage), by ``module_fqns`` (names per stage), or as
    torchtitan does: the end stages count their embeddings and output as ``first_stage_less_layers``
    and ``last_stage_less_layers`` blocks, shared evenly over the stages ``layers_per_stage`` fill,
    or one stage per rank (two for multi-stage schedules). With ``schedule_csv`` the stages run in that
    file's order, on the ranks it gives them. Needs no process group, so a launcher can check a config
    up front. A one-line ValueError, naming these parameters, when it cannot fit."""
    try:
        schedule_cls = get_schedule_class(schedule)
    except ValueError:
        raise ValueError(f"unknown pipeline schedule '{schedule}'") from None
    single_stage = issubclass(schedule_cls, PipelineScheduleSingle)
    starts, source = _stage_starts(
        n_layers,
        pp_degree,
        schedule,
        single_stage,
        layers_per_stage,
        split_points,
        module_fqns,
        first_stage_less_layers,
        last_stage_less_layers,
    )
    stage_layers = tuple(tuple(range(a, b)) for a, b in zip(starts, [*starts[1:], n_layers]))
    _check_stages_per_rank(len(stage_layers), pp_degree, schedule, single_stage, source)
    n_microbatches = _microbatch_count(local_batch_size, microbatch_size, len(stage_layers), pp_degree, schedule)
    if not schedule_csv:
        return PipelineLayout(schedule, pp_degree, stage_layers, n_microbatches)
    stage_ranks = read_schedule_csv(schedule_csv, pp_degree, len(stage_layers), n_microbatches)
    return PipelineLayout(schedule, pp_degree, stage_layers, n_microbatches, schedule_csv, stage_ranks)


def _stage_starts(
    n_layers: int,
    pp_degree: int,
    schedule: str,
    single_stage: bool,
    layers_per_stage: int | None,
    split_points: Sequence[str],
    module_fqns: Sequence[Sequence[str]],
    first_less: int,
    last_less: int,
) -> tuple[list[int], str]:
    """First block of each stage (see ``plan_pipeline``), and the parameter that gave the split."""
    given = [
        name
        for name, value in (
            ("split_points", split_points),
            ("layers_per_stage", layers_per_stage is not None),
            ("module_fqns", module_fqns),
        )
        if value
    ]
    if len(given) > 1:
        raise ValueError(f"set {' or '.join(given)}, not {'both' if len(given) == 2 else 'several'}")
    if split_points:
        return _parse_split_points(split_points, n_layers), f"split_points {','.join(split_points)}"
    if module_fqns:
        return _parse_module_fqns(module_fqns, n_layers), "module_fqns"
    if layers_per_stage is None:
        num_stages = pp_degree * (1 if single_stage else 2)
        source = f"pp_degree {pp_degree}"
    elif layers_per_stage < 1:
        raise ValueError(f"layers_per_stage {layers_per_stage}: give 1 or more blocks per stage")
    else:
        # torchtitan's count: the end stages' weights take block places too.
        num_stages = math.ceil((n_layers + first_less + last_less) / layers_per_stage)
        source = f"layers_per_stage {layers_per_stage}"
    return _weighted_stage_starts(n_layers, num_stages, first_less, last_less, schedule, source), source


def _weighted_stage_starts(
    n_layers: int, num_stages: int, first_less: int, last_less: int, schedule: str, source: str
) -> list[int]:
    """First block of each stage when ``n_layers`` plus the end stages' weights are shared evenly
    (earlier stages taking the remainder); the end stages may hold no block, as in torchtitan."""
    share, remainder = divmod(n_layers + first_less + last_less, num_stages)
    blocks = [share + (s < remainder) for s in range(num_stages)]
    blocks[0] -= first_less
    blocks[-1] -= last_less
    if min(blocks) < 0 or min(blocks[1:-1], default=1) < 1:
        fewer_stages = "lower them" if source.startswith("layers_per_stage") else "set layers_per_stage"
        raise ValueError(
            f"{source}: {n_layers} layers are too few for {num_stages} stages of {schedule} "
            f"(the first and last count as {first_less} and {last_less} more, "
            f"first_stage_less_layers and last_stage_less_layers); {fewer_stages} or set split_points"
        )
    return [sum(blocks[:s]) for s in range(num_stages)]


def _parse_split_points(split_points: Sequence[str], n_layers: int) -> list[int]:
    """Block indices starting each stage (0 first) from ``'layers.N'`` names."""
    starts = [0]
    for point in split_points:
        prefix, _, index = point.partition(".")
        # isdecimal, not isdigit: int() refuses digits such as '²' that isdigit takes.
        if prefix != "layers" or not index.isdecimal() or not 0 < int(index) < n_layers:
            raise ValueError(f"split_points: '{point}' is not a split point; use layers.N with 0 < N < {n_layers}")
        if int(index) <= starts[-1]:
            raise ValueError(f"split_points: '{point}' is out of order; list split points in increasing order")
        starts.append(int(index))
    return starts


def _parse_module_fqns(module_fqns: Sequence[Sequence[str]], n_layers: int) -> list[int]:
    """Block indices starting each stage (0 first) from the module names of each stage."""
    last, starts, next_block = len(module_fqns) - 1, [], 0
    for s, names in enumerate(module_fqns):
        blocks, ends = [], set()
        for name in names:
            prefix, _, index = name.partition(".")
            if prefix == "layers" and index.isdecimal() and int(index) < n_layers:
                blocks.append(int(index))
            elif name in ("tok_embeddings", "norm", "output"):
                ends.add(name)
            else:
                raise ValueError(
                    f"module_fqns: '{name}' is not a module of the model; "
                    f"use tok_embeddings, layers.N with N < {n_layers}, norm or output"
                )
        expected = ({"tok_embeddings"} if s == 0 else set()) | ({"norm", "output"} if s == last else set())
        if ends != expected:
            held = ", ".join(sorted(ends)) or "none of tok_embeddings, norm, output"
            raise ValueError(
                f"module_fqns: stage {s} holds {held}; "
                "tok_embeddings goes in the first stage, norm and output in the last"
            )
        if not blocks and 0 < s < last:
            raise ValueError(f"module_fqns: stage {s} holds no block")
        if sorted(blocks) != list(range(next_block, next_block + len(blocks))):
            raise ValueError(
                f"module_fqns: stage {s} holds {', '.join(names)}; its blocks should follow "
                f"on from layers.{next_block}, each block in one stage"
            )
        starts.append(next_block)
        next_block += len(blocks)
    if next_block != n_layers:
        missing = f"layers.{next_block}" + (f" to layers.{n_layers - 1} are" if next_block < n_layers - 1 else " is")
        raise ValueError(f"module_fqns: {missing} in no stage")
    return starts


def _check_stages_per_rank(num_stages: int, pp_degree: int, schedule: str, single_stage: bool, source: str) -> None:
    if single_stage and num_stages != pp_degree:
        raise ValueError(
            f"{source} gives {num_stages} stages, but {schedule} runs one stage per rank (pp_degree {pp_degree})"
        )
    if num_stages % pp_degree or (not single_stage and num_stages < 2 * pp_degree):
        raise ValueError(
            f"{source} gives {num_stages} stages, but {schedule} needs a multiple of pp_degree "
            f"{pp_degree} with at least two stages per rank"
        )
    if schedule in V_SCHEDULES and num_stages != 2 * pp_degree:
        raise ValueError(
            f"{source} gives {num_stages} stages, but {schedule} runs exactly two stages per rank "
            f"({2 * pp_degree} for pp_degree {pp_degree})"
        )


def _microbatch_count(
    local_batch_size: int, microbatch_size: int, num_stages: int, pp_degree: int, schedule: str
) -> int:
    """``local_batch_size / microbatch_size``, checked against the schedule's constraints (which
    torch reports mid-construction, or not at all)."""
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        raise ValueError(f"microbatch_size {microbatch_size} does not divide local_batch_size {local_batch_size}")
    n_microbatches = local_batch_size // microbatch_size
    where = f"local_batch_size {local_batch_size} / microbatch_size {microbatch_size}"
    if schedule == "1F1B" and n_microbatches < num_stages:
        raise ValueError(
            f"{where} = {n_microbatches} microbatches, but 1F1B needs at least one per stage ({num_stages})"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        # Microbatches go round the ranks in rounds of (at most) pp_degree.
        rounds = max(1, n_microbatches // pp_degree)
        if n_microbatches % rounds:
            raise ValueError(
                f"{where} = {n_microbatches} microbatches, but {schedule} needs them to divide into "
                f"rounds of equal size ({rounds} rounds for pp_degree {pp_degree})"
            )
    return n_microbatches


def split_stage(model: nn.Module, layout: PipelineLayout, stage_index: int) -> nn.Module:
    """A copy of ``model`` (on the meta device: free) keeping only what stage ``stage_index`` runs."""
    stage = copy.deepcopy(model)
    kept = {str(i) for i in layout.stage_layers[stage_index]}
    for name in list(stage.layers.keys()):
        if name not in kept:
            del stage.layers[name]
    if stage_index > 0:
        stage.tok_embeddings = None
    if stage_index < layout.num_stages - 1:
        stage.norm = None
        stage.output = None
    return stage


def build_schedule(
    layout: PipelineLayout,
    stage_models: Sequence[nn.Module],
    *,
    pp_rank: int,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Schedule:
    """The schedule running ``stage_models`` (this rank's, in ``layout.stage_indices`` order,
    materialized) with ``loss_fn`` on the last stage; stage shapes are inferred at the first step."""
    stages = [
        PipelineStage(model, stage_index, layout.num_stages, device, group=pp_group)
        for model, stage_index in zip(stage_models, layout.stage_indices(pp_rank), strict=True)
    ]
    if layout.schedule_csv:
        return build_csv_schedule(layout.schedule_csv, stages, layout.n_microbatches, loss_fn)
    schedule_cls = get_schedule_class(layout.schedule)
    stage_arg = stages[0] if issubclass(schedule_cls, PipelineScheduleSingle) else stages
    return schedule_cls(stage_arg, n_microbatches=layout.n_microbatches, loss_fn=loss_fn, scale_grads=False)

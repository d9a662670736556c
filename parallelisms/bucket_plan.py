"""Bucket plans for SimpleFSDP: which modules share one all-gather and one reduce-scatter.

Overlap (buckets ``B_0 .. B_{n-1}`` in forward order, one step per bucket). Forward step ``i`` runs
``F_i`` while ``AG(B_{i+1})`` is prefetched: exposed_forward[i] = ``AG(B_0)`` for i = 0, else
``max(0, AG(B_i) - F_{i-1})``. Backward runs ``B_{n-1} .. B_0``; during ``G_i`` run
``RS(B_{i+1})`` and the re-gather ``AG(B_{i-1})``: exposed_backward[i] =
``max(0, RS(B_{i+1}) + AG(B_{i-1}) - G_i)``, plus the unhidden ``AG(B_{n-1})`` on step ``n-1``
and ``RS(B_0)`` on step 0. Only resharded (``regathered``) units are gathered again. Two
consecutive buckets' gathered weights are alive together: their sum must stay under the memory cap.

Auto (``plan_auto``): the SimpleFSDP paper's cost model, searched over uniform plans. Its greedy
plans put blocks at different offsets of differently sized buckets, and Inductor compiles the code
that copies a parameter out of its bucket once per layout (compile time grew with the largest
bucket). So auto keeps the blocks (the longest run of units alike) in buckets of ``k`` blocks, the
units before and after them in one bucket each, and picks the ``k`` with the least predicted
exposed communication (the smallest on a tie), growing ``k`` only while the memory cap holds.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from parallelisms.cost_model import CommModel, ComputeModel

logger = logging.getLogger(__name__)

_MIB = 1024**2


@dataclass(frozen=True)
class PlanUnit:
    """One module in forward execution order; ``param_bytes`` unsharded, in the all-gather dtype."""

    name: str
    param_bytes: int
    forward_flops: float
    backward_flops: float
    regathered: bool = True
    """Whether backward gathers the weights again when resharding after forward."""


@dataclass
class Bucket:
    """Modules whose parameters share one all-gather and one reduce-scatter (no predictions: None)."""

    units: list[str]
    param_bytes: int
    predicted_exposed_forward_s: float | None
    predicted_exposed_backward_s: float | None


@dataclass
class BucketPlan:
    """Buckets in forward execution order; together they hold every unit exactly once."""

    buckets: list[Bucket]

    def describe(self) -> str:
        lines = [f"{'bucket':>6}  {'modules':<40}  {'MiB':>9}  {'exposed fwd ms':>14}  {'exposed bwd ms':>14}"]
        for index, bucket in enumerate(self.buckets):
            lines.append(
                f"{index:>6}  {_summarize_names(bucket.units):<40}  {bucket.param_bytes / _MIB:>9.2f}  "
                f"{_milliseconds(bucket.predicted_exposed_forward_s):>14}  "
                f"{_milliseconds(bucket.predicted_exposed_backward_s):>14}"
            )
        total_bytes = sum(bucket.param_bytes for bucket in self.buckets)
        total_forward = _sum_or_none([bucket.predicted_exposed_forward_s for bucket in self.buckets])
        total_backward = _sum_or_none([bucket.predicted_exposed_backward_s for bucket in self.buckets])
        lines.append(
            f"{'total':>6}  {f'{len(self.buckets)} buckets':<40}  {total_bytes / _MIB:>9.2f}  "
            f"{_milliseconds(total_forward):>14}  {_milliseconds(total_backward):>14}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> BucketPlan:
        return cls([Bucket(**bucket) for bucket in data["buckets"]])


def saved_or_new_plan(
    folder: str | None, key: dict, make_plan: Callable[[], BucketPlan], group: dist.ProcessGroup
) -> tuple[BucketPlan, str | None]:
    """The plan an earlier start saved in ``folder`` for the same ``key``, else ``make_plan()`` (run
    by every rank of ``group``) saved there; and the file's path when the plan was read from it.
    An auto plan rests on timings, and a different plan is a different compiled graph: a restart
    would miss the compile caches. The first rank decides for all, even where the folder is not
    shared."""
    text = json.dumps(key, sort_keys=True)
    path = os.path.join(folder, f"auto_{hashlib.sha1(text.encode()).hexdigest()[:16]}.json") if folder else None
    first = dist.get_rank(group) == 0
    saved = None
    if first and path and os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        saved = data["plan"] if data.get("key") == json.loads(text) else None
    box = [saved]
    dist.broadcast_object_list(box, group=group, group_src=0)
    if box[0] is not None:
        return BucketPlan.from_dict(box[0]), path
    plan = make_plan()
    if first and path:
        os.makedirs(folder, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump({"key": key, "plan": plan.to_dict()}, f, indent=1)
        os.replace(partial, path)  # whole or absent: ranks of other groups may write the same file
    return plan, None


def _summarize_names(names: list[str]) -> str:
    # A 32-layer bucket on one line would push the numbers off screen.
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} modules)"


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _sum_or_none(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) if len(known) == len(values) else None


@dataclass(frozen=True)
class _Costs:
    """Per-bucket times under one set of cost models."""

    comm: CommModel
    compute: ComputeModel
    world_size: int
    reduce_scatter_bytes_factor: float
    reshard_after_forward: bool

    def all_gather(self, units: Sequence[PlanUnit]) -> float:
        return self.comm.all_gather_time(sum(unit.param_bytes for unit in units), self.world_size)

    def regather(self, units: Sequence[PlanUnit]) -> float:
        return self.all_gather([unit for unit in units if unit.regathered]) if self.reshard_after_forward else 0.0

    def reduce_scatter(self, units: Sequence[PlanUnit]) -> float:
        gradient_bytes = sum(unit.param_bytes for unit in units) * self.reduce_scatter_bytes_factor
        return self.comm.reduce_scatter_time(gradient_bytes, self.world_size)

    def forward(self, units: Sequence[PlanUnit]) -> float:
        return self.compute.time(sum(unit.forward_flops for unit in units))

    def backward(self, units: Sequence[PlanUnit]) -> float:
        return self.compute.time(sum(unit.backward_flops for unit in units))


def _predict(groups: list[list[PlanUnit]], costs: _Costs) -> BucketPlan:
    """Buckets with the exposed communication of each step (module docstring)."""
    count = len(groups)
    buckets = []
    for i, group in enumerate(groups):
        if i == 0:
            exposed_forward = costs.all_gather(group)
        else:
            exposed_forward = max(0.0, costs.all_gather(group) - costs.forward(groups[i - 1]))
        overlapped = (costs.reduce_scatter(groups[i + 1]) if i + 1 < count else 0.0) + (
            costs.regather(groups[i - 1]) if i > 0 else 0.0
        )
        exposed_backward = max(0.0, overlapped - costs.backward(group))
        if i == count - 1:
            exposed_backward += costs.regather(group)
        if i == 0:
            exposed_backward += costs.reduce_scatter(group)
        buckets.append(
            Bucket(
                units=[unit.name for unit in group],
                param_bytes=sum(unit.param_bytes for unit in group),
                predicted_exposed_forward_s=exposed_forward,
                predicted_exposed_backward_s=exposed_backward,
            )
        )
    return BucketPlan(buckets)


def plan_auto(
    units: Sequence[PlanUnit],
    comm: CommModel,
    compute: ComputeModel,
    world_size: int,
    memory_cap_bytes: int,
    *,
    reduce_scatter_bytes_factor: float = 1.0,
    reshard_after_forward: bool = True,
) -> BucketPlan:
    """Uniform buckets of blocks, sized by the paper's cost model (module docstring).
    ``memory_cap_bytes`` caps two consecutive buckets' gathered bytes (one block per bucket is
    planned even above it); ``reduce_scatter_bytes_factor`` is gradient bytes per gathered byte."""
    costs = _Costs(comm, compute, world_size, reduce_scatter_bytes_factor, reshard_after_forward)
    start, stop = _repeated_run(units)
    head, blocks, tail = list(units[:start]), list(units[start:stop]), list(units[stop:])

    best, best_exposed = None, math.inf
    for size in range(1, len(blocks) + 1):
        plan = _predict([group for group in [head, *_chunks(blocks, size), tail] if group], costs)
        if size > 1 and _over_cap(plan, memory_cap_bytes):
            break  # larger groups only hold more
        exposed = sum(b.predicted_exposed_forward_s + b.predicted_exposed_backward_s for b in plan.buckets)
        logger.debug("Auto buckets of %d blocks: %.3e s of exposed communication predicted", size, exposed)
        if exposed < best_exposed:
            best, best_exposed = plan, exposed
    if _over_cap(best, memory_cap_bytes):
        logger.warning(
            "Auto buckets: one block per bucket already exceeds the memory cap of %d B with its neighbour; "
            "a module cannot be split, so it is planned anyway",
            memory_cap_bytes,
        )
    return best


def _repeated_run(units: Sequence[PlanUnit]) -> tuple[int, int]:
    """``[start, stop)`` of the longest run of consecutive units with equal bytes and FLOPs (a
    model's blocks); the first such run on a tie."""
    best = (0, 1)
    start = 0
    for index in range(1, len(units) + 1):
        ends = index == len(units) or dataclasses.astuple(units[index])[1:] != dataclasses.astuple(units[start])[1:]
        if ends:
            if index - start > best[1] - best[0]:
                best = (start, index)
            start = index
    return best


def _chunks(blocks: list[PlanUnit], size: int) -> list[list[PlanUnit]]:
    return [blocks[i : i + size] for i in range(0, len(blocks), size)]


def _over_cap(plan: BucketPlan, memory_cap_bytes: int) -> bool:
    """Whether some bucket with the one before it gathers more than the cap."""
    sizes = [bucket.param_bytes for bucket in plan.buckets]
    return any(before + size > memory_cap_bytes for before, size in zip([0, *sizes], sizes))


def _parse_spec(spec: str) -> list[str]:
    patterns = [part.strip() for part in spec.split("+")]
    if not all(patterns):
        raise ValueError(f"Bucket spec {spec!r} has an empty pattern; write 'name+name', e.g. 'norm+output'")
    return patterns


def plan_manual(units: Sequence[PlanUnit], patterns: Sequence[str]) -> BucketPlan:
    """Buckets named by the user: each spec is one bucket of ``+``-joined fnmatch patterns over unit
    names (``"layers.*"`` puts every layer in ONE bucket), contiguous in execution order (a bucket
    is gathered at one point in time). Units no spec matches get a bucket each."""
    names = [unit.name for unit in units]
    owner: dict[str, str] = {}
    groups: list[list[int]] = []
    for spec in patterns:
        indices: set[int] = set()
        for pattern in _parse_spec(spec):
            matched = {i for i, name in enumerate(names) if fnmatch.fnmatchcase(name, pattern)}
            if not matched:
                raise ValueError(f"Bucket pattern {pattern!r} (in spec {spec!r}) matches no module of {names}")
            indices |= matched
        for i in sorted(indices):
            if names[i] in owner:
                raise ValueError(
                    f"Module {names[i]!r} is matched by two bucket specs: {owner[names[i]]!r} and {spec!r}"
                )
            owner[names[i]] = spec
        ordered = sorted(indices)
        if ordered[-1] - ordered[0] + 1 != len(ordered):
            gaps = [names[i] for i in range(ordered[0], ordered[-1]) if i not in indices]
            raise ValueError(
                f"Bucket spec {spec!r} is not contiguous in execution order: it matches "
                f"{[names[i] for i in ordered]} but not {gaps} in between"
            )
        groups.append(ordered)
    groups.extend([i] for i, name in enumerate(names) if name not in owner)
    groups.sort(key=lambda indices: indices[0])
    return BucketPlan(
        [
            Bucket(
                units=[names[i] for i in group],
                param_bytes=sum(units[i].param_bytes for i in group),
                predicted_exposed_forward_s=None,
                predicted_exposed_backward_s=None,
            )
            for group in groups
        ]
    )


def default_manual_patterns(unit_names: Sequence[str]) -> list[str]:
    """``tok_embeddings``, each ``layers.<i>``, and ``norm+output`` (those this stage has)."""
    tail = [name for name in unit_names if name in ("norm", "output")]
    patterns = []
    for name in unit_names:
        if name not in tail:
            patterns.append(glob.escape(name))  # a literal name, even with fnmatch metacharacters
        elif name == tail[0]:
            patterns.append("+".join(glob.escape(tail_name) for tail_name in tail))
    return patterns

"""Custom pipeline schedules read from a CSV file in torch's format (``torch.distributed.pipelining``'s
``_load_csv``): a row per pipeline rank, a cell per action in the order the rank runs them, such as
``0F1`` (stage 0's forward of microbatch 1), ``0B1`` (its full backward), ``0I1`` and ``0W1`` (its
input and weight gradients), an empty cell for an idle slot. torch's runtime adds the sends, receives
and gradient reductions between them, and the CSV's actions say which rank runs which stage."""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime, _validate_schedule


def read_schedule_csv(path: str, pp_degree: int, num_stages: int, n_microbatches: int) -> tuple[int, ...]:
    """The pipeline rank of each stage in the schedule of the CSV file at ``path``, checked by torch for
    ``pp_degree`` ranks, ``num_stages`` stages and ``n_microbatches``; a one-line ValueError naming
    ``schedule_csv`` when the file is missing, unreadable or not such a schedule."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"schedule_csv: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    actions = {rank: [_action(path, rank, cell, num_stages) for cell in row] for rank, row in enumerate(rows)}
    if len(rows) != pp_degree:
        raise ValueError(f"schedule_csv: {path} has {len(rows)} rows of actions, one per rank of pp_degree {pp_degree}")
    try:
        stage_ranks = _validate_schedule(actions, pp_degree, num_stages, n_microbatches)
    except AssertionError as e:  # torch's message; its first line says what is wrong
        line = " ".join(str(e).splitlines()[0].split()).replace("_ComputationType.FORWARD", "F")
        raise ValueError(f"schedule_csv: {path}: {line}") from None
    if missing := sorted(set(range(num_stages)) - stage_ranks.keys()):
        raise ValueError(f"schedule_csv: {path} runs no action of stage {missing[0]} of {num_stages}")
    if idle := sorted(set(range(pp_degree)) - set(stage_ranks.values())):
        raise ValueError(f"schedule_csv: {path} gives rank {idle[0]} no stage to run")
    return tuple(stage_ranks[s] for s in range(num_stages))


def _action(path: str, rank: int, cell: str, num_stages: int) -> _Action | None:
    """One cell as torch's action; a ValueError for what torch would not run."""
    where = f"schedule_csv: {path} row {rank + 1}: {cell.strip()!r}"
    try:
        action = _Action.from_str(cell)
    except RuntimeError:
        raise ValueError(f"{where} is not an action such as 0F1 (stage, F/B/I/W, microbatch)") from None
    if action is None:
        return None
    if not action.is_compute_op or action.sub_actions is not None:
        raise ValueError(f"{where}: only computations (F, B, I, W); the runtime adds communication")
    if action.stage_index >= num_stages or action.microbatch_index is None:
        raise ValueError(f"{where} names no microbatch of stage 0 to {num_stages - 1}")
    return action


def build_csv_schedule(
    path: str,
    stages: Sequence[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineScheduleRuntime:
    """torch's runtime running ``stages`` (this rank's) in the order of the CSV file at ``path``; gradients
    left unscaled, as the built-in schedules' (the loss is already the global mean's share)."""
    schedule = _PipelineScheduleRuntime(list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule._load_csv(path)
    return schedule

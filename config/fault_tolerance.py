"""The ``[fault_tolerance]`` section (torchtitan's names): replica groups that train together through
torchft, each its own torchrun, so that one group's failure leaves the others training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from config.errors import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the lighthouse's http://host:port


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one replica group of several (torchft): each group is its own run_train.sh launch with the
    parallelism degrees of one group; they average gradients each step and a group that fails rejoins by
    taking a live group's state. Needs a lighthouse at env TORCHFT_LIGHTHOUSE (docs/fault-tolerance.md)."""
    replica_id: int = 0
    """This group's number, 0 to group_size - 1: its share of the data."""
    group_size: int = 0
    """The replica groups of the job (their count): the data is split among them."""
    min_replica_size: int = 1
    """Groups a step needs to be committed; with fewer alive, the steps wait for more (not trained)."""
    process_group: Literal["gloo", "nccl"] = "gloo"
    """The collectives between the groups: gloo (CPU tensors or CUDA) or nccl (CUDA)."""
    process_group_timeout_ms: int = 10000
    """How long an all-reduce between the groups waits for a peer before the step is given up."""
    semi_sync_method: str | None = None
    """torchtitan's DiLoCo or local SGD; not built: unset trains every step in sync."""


def check_fault_tolerance(ft: FaultTolerance, early_step_in_backward: bool) -> None:
    """The section's mistakes, when enabled."""
    if not ft.enable:
        return
    if early_step_in_backward:
        raise ConfigError(
            "optimizer.early_step_in_backward: not with fault_tolerance.enable (a gradient is averaged across "
            "the replica groups before any update)"
        )
    if ft.semi_sync_method is not None:
        raise ConfigError(
            f"fault_tolerance.semi_sync_method: '{ft.semi_sync_method}' is not built (DiLoCo, local SGD); "
            "leave it unset to average the gradients every step"
        )
    if ft.group_size < 1:
        raise ConfigError(
            f"fault_tolerance.group_size must be the number of replica groups (1 or more), got {ft.group_size}"
        )
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id {ft.replica_id} is not a group of the {ft.group_size} "
            f"(fault_tolerance.group_size): 0 to {ft.group_size - 1}"
        )
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size {ft.min_replica_size} must be 1 to the {ft.group_size} groups "
            "(fault_tolerance.group_size): a step would wait for groups that do not exist"
        )
    if ft.process_group_timeout_ms < 1:
        raise ConfigError(
            f"fault_tolerance.process_group_timeout_ms must be positive, got {ft.process_group_timeout_ms}"
        )

"""Process-group start-up, device choice and the DeviceMesh of a run."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ConfigError, Parallelism

logger = logging.getLogger(__name__)


def device_type() -> str:
    """The accelerator's type when there is one (cuda, xpu, ...), otherwise cpu."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


def init_distributed(init_timeout_seconds: int) -> torch.device:
    """Joins the job's process group (a group of one without torchrun) and returns this rank's device."""
    dev_type = device_type()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(dev_type, local_rank) if dev_type != "cpu" else torch.device("cpu")
    if dev_type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    if dist.is_initialized():  # a second Trainer in the same process (benchmarks, tests)
        return device
    backend = dist.get_default_backend_for_device(device)
    timeout = datetime.timedelta(seconds=init_timeout_seconds)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return device
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # After an elastic restart the agent's store still holds the dead attempt's addresses and gloo
    # would connect to them; a per-attempt key prefix gives every attempt a clean namespace.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
        use_libuv=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"tessera/attempt_{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return device


def set_collective_timeout(seconds: int, mesh: DeviceMesh | None) -> None:
    """Switches every group (the default one and the mesh's) to the steady-state timeout."""
    timeout = datetime.timedelta(seconds=seconds)
    groups = {dist.group.WORLD}
    if mesh is not None:
        groups.update(mesh.get_all_groups())
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


@dataclass
class ParallelDims:
    """Degrees of each parallelism; their product is the world size.

    Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Only degrees above one get a
    dimension; ``dp`` is the flattened (dp_replicate, dp_shard) mesh that data loading and loss
    averaging use.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        others = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by data_parallel_replicate_degree"
                    f" x tensor_parallel_degree x pipeline_parallel_degree = {others}"
                )
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {others * self.dp_shard} "
                f"(replicate {self.dp_replicate} x shard {self.dp_shard} x tp {self.tp} x pp {self.pp})"
                f" but the world size is {self.world_size}"
            )

    @classmethod
    def from_config(cls, parallelism: Parallelism, world_size: int) -> ParallelDims:
        return cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            world_size=world_size,
        )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        dims = [
            (name, size)
            for name, size in (
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("tp", self.tp),
            )
            if size > 1
        ] or [("dp_shard", 1)]
        names, sizes = zip(*dims)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        dp_dims = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
        if len(dp_dims) == 2:
            mesh[dp_dims]._flatten("dp")
        logger.info("device mesh %s", dict(dims))
        return mesh

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The flattened data-parallel mesh, or None when there is no data parallelism."""
        if not self.dp_enabled:
            return None
        if self.dp_replicate_enabled and self.fsdp_enabled:
            return mesh["dp"]
        return mesh["dp_replicate" if self.dp_replicate_enabled else "dp_shard"]

    def dp_rank_and_size(self, mesh: DeviceMesh) -> tuple[int, int]:
        dp_mesh = self.dp_mesh(mesh)
        return (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)

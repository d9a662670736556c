"""The degrees of each parallelism and the DeviceMesh they span."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallelisms.torch_release import stable_mesh_hash

logger = logging.getLogger(__name__)


def _hash_meshes_stably() -> None:
    """Before Python 3.12 ``hash(None)`` is an address, and a DeviceMesh's hash covers a None field,
    so it differs between processes; torch.compile's cache keys pickle it, and SimpleFSDP's graphs
    would miss the caches at every start. A stable hash instead, before any mesh is hashed."""
    if sys.version_info < (3, 12):
        DeviceMesh.__hash__ = stable_mesh_hash


@dataclass
class ParallelDims:
    """Degrees of each parallelism, multiplying to the world size, and the mesh once built: dims pp,
    dp_replicate, dp_shard, tp (those above one), and ``dp`` flattening the data-parallel ones."""

    dp_replicate: int
    dp_shard: int  # -1: the ranks the other degrees leave
    tp: int
    pp: int
    world_size: int
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        others = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by the other degrees "
                    f"(replicate {self.dp_replicate} x tp {self.tp} x pp {self.pp} = {others})"
                )
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                f"parallelism degrees multiply to {others * self.dp_shard} "
                f"(replicate {self.dp_replicate} x shard {self.dp_shard} x tp {self.tp} x pp {self.pp})"
                f" but the world size is {self.world_size}"
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
        """Creates the mesh (a collective over the default group)."""
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
        _hash_meshes_stably()
        self.mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        if self.dp_replicate_enabled and self.fsdp_enabled:
            self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        logger.info("device mesh %s", dict(dims))
        return self.mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The flattened data-parallel mesh, or None when there is no data parallelism."""
        if not self.dp_enabled:
            return None
        if self.dp_replicate_enabled and self.fsdp_enabled:
            return self.mesh["dp"]
        return self.mesh["dp_replicate" if self.dp_replicate_enabled else "dp_shard"]

    @property
    def dp_param_mesh(self) -> DeviceMesh:
        """The data-parallel dims that hold parameters, unflattened."""
        enabled = (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.fsdp_enabled))
        return self.mesh[tuple(name for name, on in enabled if on)]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.tp_enabled else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.mesh["pp"] if self.pp_enabled else None

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_enabled else 0

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


# The data-parallel dims and the flattened meshes over several of them (built with the mesh).
_DATA_DIMS = ("dp_replicate", "dp_shard", "cp")
_FLATTENED = {
    ("dp_replicate", "dp_shard"): "dp",  # batches: one per data-parallel rank
    ("dp_shard", "cp"): "dp_shard_cp",  # parameters shard over the context-parallel ranks too
    ("dp_replicate", "dp_shard", "cp"): "dp_cp",  # every rank holding other tokens: loss and gradient sums
}


@dataclass
class ParallelDims:
    """Degrees of each parallelism, multiplying to the world size, and the mesh once built: dims pp,
    dp_replicate, dp_shard, cp, tp (those above one), with flattened meshes over the data-parallel
    ones (``_FLATTENED``). A context-parallel group reads its data-parallel rank's batch, each rank
    keeping its chunks of the sequence, and shards the parameters with the data-parallel ranks."""

    dp_replicate: int
    dp_shard: int  # -1: the ranks the other degrees leave
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        others = self.dp_replicate * self.cp * self.tp * self.pp
        degrees = f"replicate {self.dp_replicate} x cp {self.cp} x tp {self.tp} x pp {self.pp}"
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by the other degrees ({degrees} = {others})"
                )
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                f"parallelism degrees multiply to {others * self.dp_shard} "
                f"(shard {self.dp_shard} x {degrees}) but the world size is {self.world_size}"
            )

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: each reads its own batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def dp_cp_enabled(self) -> bool:
        """Whether the parameters are data parallel (over the data-parallel and context-parallel ranks)."""
        return self.dp_enabled or self.cp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        """Whether the parameters are sharded (over dp_shard x cp)."""
        return self.dp_shard > 1 or self.cp_enabled

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def _size(self, name: str) -> int:
        return getattr(self, name)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Creates the mesh (a collective over the default group)."""
        order = ("pp", *_DATA_DIMS, "tp")
        dims = [(name, self._size(name)) for name in order if self._size(name) > 1] or [("dp_shard", 1)]
        names, sizes = zip(*dims)
        _hash_meshes_stably()
        self.mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        for flattened, name in _FLATTENED.items():
            enabled = tuple(d for d in flattened if self._size(d) > 1)
            if len(enabled) > 1:
                self.mesh[enabled]._flatten(name)
        logger.info("device mesh %s", dict(dims))
        return self.mesh

    def _data_mesh(self, dims: tuple[str, ...]) -> DeviceMesh:
        """The mesh over ``dims`` (those above one; flattened when several; the one-rank mesh's
        dp_shard when none is)."""
        enabled = tuple(d for d in dims if self._size(d) > 1)
        if len(enabled) > 1:
            return self.mesh[_FLATTENED[dims]]
        return self.mesh[enabled[0] if enabled else "dp_shard"]

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The flattened data-parallel mesh (batches), or None when there is no data parallelism."""
        return self._data_mesh(("dp_replicate", "dp_shard")) if self.dp_enabled else None

    @property
    def dp_cp_mesh(self) -> DeviceMesh | None:
        """The flattened mesh of every rank holding other tokens (data x context parallel): sums of
        losses and token counts, or None when there is one."""
        return self._data_mesh(_DATA_DIMS) if self.dp_cp_enabled else None

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self.mesh["cp"] if self.cp_enabled else None

    @property
    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank() if self.cp_enabled else 0

    @property
    def dp_param_mesh(self) -> DeviceMesh:
        """The dims that hold parameters: dp_replicate, then the shard dim (dp_shard x cp), each if enabled."""
        shard_name = self._data_mesh(("dp_shard", "cp")).mesh_dim_names[0] if self.fsdp_enabled else ""
        enabled = (("dp_replicate", self.dp_replicate_enabled), (shard_name, self.fsdp_enabled))
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

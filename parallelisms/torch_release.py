"""What differs between the torch releases Tessera supports (pyproject.toml's range, 2.11 to 2.13),
decided here: the rest of the code asks these functions, never the version."""

from __future__ import annotations

import hashlib
import re

import torch
from torch._functorch import config as functorch_config
from torch.distributed.device_mesh import DeviceMesh


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    """The (major, minor) release of a torch version string such as ``2.11.0+cu130``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"version: '{version}' is not a torch version")
    return int(match[1]), int(match[2])


RELEASE = torch_release()


def reusable_checkpoint_stager() -> bool:
    """Whether one asynchronous checkpoint stager serves every save, keeping its staging buffers.
    Before 2.13 a stager forgets how to copy anything after its first save, so each save needs its own."""
    return RELEASE >= (2, 13)


def runs_v_schedules(device_type: str) -> bool:
    """Whether a V-shaped pipeline schedule (two stages per rank, handing over on the same rank)
    starts here: before 2.13 torch opens the stages with a message between every pair of neighbours,
    a rank's own pair too, which gloo cannot send."""
    return RELEASE >= (2, 13) or device_type != "cpu"


def partitioner_options(memory_budget: float) -> dict[str, object]:
    """The min-cut partitioner's settings for an activation memory budget. Under a budget it sizes
    every saved value; from 2.13 it must be told that script objects (process groups, meshes) hold no
    activations, which earlier releases assume."""
    options: dict[str, object] = {"activation_memory_budget": memory_budget}
    if hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size"):
        options["unsafe_treat_script_objects_as_zero_size"] = True
    return options


def stable_mesh_hash(mesh: DeviceMesh) -> int:
    """A DeviceMesh hash equal in every process: its device type, dim names and ranks. (Before
    Python 3.12 torch's own covers ``hash(None)``, an address.)"""
    if not getattr(mesh, "_hash", None):
        key = repr((mesh.device_type, mesh.mesh_dim_names, mesh.mesh.tolist()))
        mesh._hash = int(hashlib.blake2b(key.encode(), digest_size=8).hexdigest()[:15], 16)
    return mesh._hash

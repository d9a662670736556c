"""parallelisms/torch_release.py: the decisions that differ between the supported torch releases.
Each is also exercised where it matters by the suite run on the oldest release
(scripts/check_torch_range.sh): the async checkpoint tests save twice with one manager, the compile
tests partition under a memory budget, and every launch hashes meshes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch._functorch import config as functorch_config

from parallelisms.torch_release import partitioner_options, torch_release
from tests.launch import REPO


@pytest.mark.parametrize(
    ("version", "release"), [("2.11.0+cu130", (2, 11)), ("2.13.0", (2, 13)), ("2.14.0.dev20261101", (2, 14))]
)
def test_release_of_a_version(version, release):
    assert torch_release(version) == release


def test_a_version_that_is_not_one():
    with pytest.raises(ValueError, match="'nightly' is not a torch version"):
        torch_release("nightly")


def test_partitioner_options_are_settings_this_torch_has():
    options = partitioner_options(0.5)
    assert options["activation_memory_budget"] == 0.5
    with functorch_config.patch(options):  # raises on a setting this release lacks
        assert functorch_config.activation_memory_budget == 0.5


MESH_HASH = """
import os, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from parallelisms.parallel_dims import _hash_meshes_stably
if sys.argv[1] == "stable":
    _hash_meshes_stably()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
one, two = (init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)) for _ in range(2))
assert hash(one) == hash(two)
print(hash(one))
"""


def _mesh_hashes(mode: str) -> set[str]:
    runs = [
        subprocess.run(
            [sys.executable, "-c", MESH_HASH, mode, str(port)], cwd=REPO, capture_output=True, text=True, check=True
        )
        for port in (29621, 29622)
    ]
    return {run.stdout.strip() for run in runs}


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="from Python 3.12 hash(None) is the same in every process")
def test_a_mesh_hashes_the_same_in_every_process():
    """torch.compile's cache keys hash meshes: a hash that changes between processes misses the cache."""
    assert len(_mesh_hashes("stable")) == 1
    assert len(_mesh_hashes("torch")) == 2  # torch's own hash covers None's address

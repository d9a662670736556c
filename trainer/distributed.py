"""Process-group start-up, device choice and the DeviceMesh of a run."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import uuid

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from config.errors import ConfigError, user_input
from config.job_config import Comm, Parallelism
from parallelisms.device import backend_for, cache_freed_host_memory, rank_device
from parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


def init_distributed(comm: Comm, dump_folder: str) -> torch.device:
    """Joins the job's process group (a group of one without torchrun) and returns this rank's device."""
    device = rank_device(int(os.environ.get("LOCAL_RANK", 0)))
    if cache_freed_host_memory(device):
        logger.info("CPU: freed memory is kept for reuse (glibc malloc without mmap or trimming)")
    if dist.is_initialized():  # a second Trainer in the same process (benchmarks, tests)
        return device
    _record_collectives(comm, dump_folder)
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=comm.init_timeout_seconds)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        _join_torchrun_group(backend, timeout)
    logger.info("process group: %s backend, world size %d, device type %s", backend, dist.get_world_size(), device.type)
    return device


def _record_collectives(comm: Comm, dump_folder: str) -> None:
    """Turns torch's flight recorder on: each rank keeps its last comm.trace_buf_size collectives,
    which NCCL's watchdog writes out when one times out (other backends: ``dump_collective_trace``)."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(comm.trace_buf_size)
    if comm.trace_buf_size > 0:
        folder = os.path.join(dump_folder, comm.save_traces_folder)
        os.makedirs(folder, exist_ok=True)
        os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(folder, comm.save_traces_file_prefix)


def dump_collective_trace(comm: Comm, dump_folder: str) -> str | None:
    """Writes this rank's flight recorder to the traces folder; returns what the error line says of
    it (the folder and this rank's last collective), or None when it is not written."""
    if comm.trace_buf_size <= 0 or not dist.is_initialized():
        return None
    folder = os.path.join(dump_folder, comm.save_traces_folder)
    record = torch._C._distributed_c10d._dump_fr_trace()
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{comm.save_traces_file_prefix}{dist.get_rank()}"), "wb") as f:
            f.write(record)
    except OSError as e:  # a full disk, say: the error line goes out without it
        logger.warning("comm.save_traces_folder: cannot write the flight recorder to %s (%s)", folder, e.strerror)
        return None
    entries = pickle.loads(record)["entries"]
    if not entries:
        return folder
    last = entries[-1]
    return f"{folder} (this rank's last: {last['profiling_name']} #{last['collective_seq_id']} of {last['process_group'][1]})"


LAUNCH_ID_ENV = "TESSERA_LAUNCH_ID"


def launch_id() -> str:
    """One id for a torchrun launch and all its restarts, which checkpoint markers record."""
    return os.environ.get(LAUNCH_ID_ENV, "")


def is_first_attempt() -> bool:
    """Whether this is the launch's first start of the ranks, not torchrun's restart of them."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _join_torchrun_group(backend: str, timeout: datetime.timedelta) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # After an elastic restart the agent's store still holds the dead attempt's addresses and gloo
    # would connect to them; a per-attempt key prefix gives every attempt a clean namespace.
    store = torchrun_store(timeout)
    # The first rank to ask names the launch, in the store that the restarts and the other nodes
    # share; under the run's id, as jobs on one rendezvous port share a store.
    key = f"tessera/launch/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    os.environ[LAUNCH_ID_ENV] = store.compare_set(key, "", uuid.uuid4().hex).decode()
    store = dist.PrefixStore(f"tessera/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def torchrun_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of torchrun's store, which outlives the ranks of every node."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, use_libuv=True)


def set_collective_timeout(seconds: int, mesh: DeviceMesh | None) -> None:
    """Switches every group of this process, the checkpoint manager's too, to the training timeout."""
    timeout = datetime.timedelta(seconds=seconds)
    groups = {dist.group.WORLD, *dist.distributed_c10d._world.pg_map}
    if mesh is not None:
        groups.update(mesh.get_all_groups())
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def parallel_dims_from_config(parallelism: Parallelism, world_size: int) -> ParallelDims:
    """The degrees ``parallelism`` asks for; a one-line ConfigError when they do not make ``world_size``."""
    with user_input():
        return ParallelDims(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            world_size=world_size,
            cp=parallelism.context_parallel_degree,
        )


def elastic_parallelism(parallelism: Parallelism, world_size: int) -> Parallelism:
    """``parallelism`` at the world size of a job that lost or regained nodes: its degrees where they
    make ``world_size``; else its tensor, context and pipeline degrees, with the data-parallel ranks
    re-derived: the shard degree kept where it divides them, replicated across the rest (the layout
    planner's HSDP: shard within a node, replicate across nodes), else all of them sharding."""
    try:
        parallel_dims_from_config(parallelism, world_size)
        return parallelism
    except ConfigError:
        pass
    p = parallelism
    split = p.tensor_parallel_degree * p.context_parallel_degree * p.pipeline_parallel_degree
    if world_size % split:
        raise ConfigError(
            f"parallelism: tensor {p.tensor_parallel_degree} x context {p.context_parallel_degree} x pipeline "
            f"{p.pipeline_parallel_degree} degrees = {split} do not divide a world of {world_size} ranks"
        )
    dp, shard = world_size // split, p.data_parallel_shard_degree
    replicate = dp // shard if shard > 0 and dp % shard == 0 else 1
    return dataclasses.replace(p, data_parallel_replicate_degree=replicate, data_parallel_shard_degree=dp // replicate)

"""Replica groups through torchft (``fault_tolerance.enable``): each group is its own torchrun; each rank
has a torchft Manager that pairs it with the ranks of the same group rank in the other groups. Every step
starts a quorum of the live groups, averages each gradient's local shard over them, and steps the optimizer
only when the step is committed. A group that (re)joins behind the others takes a live peer's model,
optimizer, LR schedule and step over torchft's transport, and its own data position from its dump folder."""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.tensor import DTensor

from config.errors import ConfigError, first_line
from config.fault_tolerance import LIGHTHOUSE_ENV, FaultTolerance
from config.job_config import JobConfig
from trainer.optim import optimizers_holding_state

logger = logging.getLogger(__name__)

NOT_INSTALLED = (
    "fault_tolerance.enable: torchft is not installed: pip install torchft==0.2.0 (or pip install -e '.[ft]')"
)
LIGHTHOUSE_HELP = "start one with: torchft_lighthouse --min_replicas 1 --bind [::]:29510 --join_timeout_ms 1000"
DATA_POSITION_FOLDER = "fault_tolerance"  # in job.dump_folder: each rank's data position after its last commit


def lighthouse_address() -> tuple[str, int]:
    """(host, port) of the lighthouse at TORCHFT_LIGHTHOUSE, or the one line of what is wrong with it."""
    address = os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            f"fault_tolerance.enable: set {LIGHTHOUSE_ENV}=http://host:port of the lighthouse; {LIGHTHOUSE_HELP}"
        )
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None:
        raise ConfigError(f"{LIGHTHOUSE_ENV}: '{address}' is not http://host:port of the lighthouse")
    return url.hostname, port


def check_fault_tolerance_environment(ft: FaultTolerance) -> None:
    """Before the ranks start: torchft installed, the lighthouse answering (within 3 s), nccl only on CUDA."""
    if not ft.enable:
        return
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(NOT_INSTALLED) from None
    if ft.process_group == "nccl" and not torch.cuda.is_available():
        raise ConfigError("fault_tolerance.process_group: nccl needs CUDA devices; take gloo on these ranks")
    host, port = lighthouse_address()
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            f"{LIGHTHOUSE_ENV}: no lighthouse answers at {host}:{port} ({reason}); {LIGHTHOUSE_HELP}"
        ) from None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard: what pairs up with the same group rank's shard in every other group."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def params_checksum(params: list[torch.Tensor]) -> int:
    """An integer of the weights' bits, summed over the group's ranks: equal in groups whose weights are equal."""
    # Summed where the weights are, one transfer to the host at the end.
    total = torch.zeros((), dtype=torch.int64, device=params[0].device if params else None)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for param in params:
        local = _local(param.detach()).contiguous().flatten()
        total += local.view(bits[local.element_size()]).sum(dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item()) % 2**48  # exact in JSON and in a float64


class GroupState:
    """What a rejoining group takes from a live one: this rank's shards of the weights and optimizer state,
    the optimizer's hyperparameters, the LR schedule and the step."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.params = [p for part in trainer.model.parts for p in part.parameters()]
        self.optimizers = optimizers_holding_state(trainer.optimizer)
        self.healed = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": [_local(p.detach()) for p in self.params],
            "optimizers": [
                {
                    "state": [{k: _local(v) for k, v in opt.state.get(p, {}).items()} for p in _params_of(opt)],
                    "groups": [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups],
                }
                for opt in self.optimizers
            ],
            "lr_scheduler": self.trainer.lr_scheduler.state_dict(),
            "step": self.trainer.step,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            if any(saved["state"]):
                _init_optim_state(opt)  # a group that has not stepped yet has no moments to copy into
            for param, values in zip(_params_of(opt), saved["state"], strict=True):
                if not values:  # not stepped in the live group: Adam's step count starts at 0 here too
                    opt.state.pop(param, None)
                for key, value in values.items():
                    _local(opt.state[param][key]).copy_(value)
            for group, hyper in zip(opt.param_groups, saved["groups"], strict=True):
                group.update(hyper)
        for param, value in zip(self.params, state["model"], strict=True):
            _local(param).copy_(value)
        self.trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.trainer.step = state["step"]
        self.trainer._refresh_float8_scales()
        self.healed = True
        logger.info("took a live replica group's state at step %d", self.trainer.step)


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class ReplicaGroups:
    """This rank's torchft Manager: the quorum of live groups, the gradient averaging and the commit of each step."""

    def __init__(self, trainer: Any):
        # torchft logs every step's quorum and commit (its Rust side by RUST_LOG), and a traceback per gradient
        # of a failed all-reduce: the warning of the uncommitted step says it once.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # torch's streaming load of a state from a live group reads from a read-only buffer, and copies it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        try:
            from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        except ImportError:
            raise ConfigError(NOT_INSTALLED) from None
        ft: FaultTolerance = trainer.config.fault_tolerance
        self.trainer, self.ft = trainer, ft
        self.state = GroupState(trainer)
        lighthouse_address()  # one line when the variable is missing (a launch without run_train.sh)
        timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
        pg = (ProcessGroupGloo if ft.process_group == "gloo" else ProcessGroupNCCL)(timeout=timeout)
        rank, world_size = dist.get_rank(), dist.get_world_size()

        def manager() -> Manager:
            return Manager(
                pg=pg,
                load_state_dict=self.state.load_state_dict,
                state_dict=self.state.state_dict,
                min_replica_size=ft.min_replica_size,
                use_async_quorum=False,  # a rejoining group takes the state before its forward, and trains its batch
                replica_id=f"tessera_{ft.replica_id}",
                rank=rank,
                world_size=world_size,
            )

        # Group rank 0 publishes its manager's address in torchrun's store first: a restarted group's other
        # ranks would otherwise read the previous attempt's.
        self.manager = manager() if rank == 0 else None
        dist.barrier()
        self.manager = self.manager or manager()
        self.data_file = os.path.join(trainer.config.job.dump_folder, DATA_POSITION_FOLDER, f"data_rank_{rank}.pt")
        os.makedirs(os.path.dirname(self.data_file), exist_ok=True)
        self.quorum_started = False
        self.participants = 0

    def start_data(self, start: Callable[[str | None], Iterator], resumed: str | None) -> Iterator:
        """The run's first quorum, then ``start(resumed)``'s batches. A group behind the live ones takes their
        state here, and its own data position (saved at each commit, newer than its checkpoint's), so that it
        neither skips nor repeats a batch of its share."""
        self._start_quorum()
        if self.state.healed and os.path.isfile(self.data_file):
            self.trainer.dataloader.load_state_dict(torch.load(self.data_file, weights_only=False))
        return start(resumed)

    def _start_quorum(self) -> None:
        """The step's quorum (once per step), waiting while it has fewer than min_replica_size groups."""
        if self.quorum_started:
            return
        while True:
            self.manager.load_state_dict({"step": self.trainer.step, "batches_committed": 0})
            self.manager.start_quorum()
            participants = self.manager.num_participants()
            if participants != self.participants:
                logger.info("replica groups in the quorum: %d (step %d)", participants, self.trainer.step)
                self.participants = participants
            if participants >= self.ft.min_replica_size:
                break
            time.sleep(1)  # the lighthouse forms the next quorum when a group comes or goes
        self.quorum_started = True

    def average_and_commit(self, params: list[torch.Tensor]) -> dict[str, int] | None:
        """Averages each gradient's local shard over the quorum's groups; whether every rank of this group may
        step: None when an all-reduce failed (a group died in the step), else the quorum's size and the checksum
        of the weights the step starts from. A committed step's data position is saved."""
        healed = self.state.healed
        self._start_quorum()
        if self.state.healed != healed:
            raise RuntimeError(
                f"replica group {self.ft.replica_id} fell behind a step the other groups committed: it restarts "
                "(torchrun's MAX_RESTARTS) to rejoin them"
            )
        works = [self.manager.allreduce(_local(p.grad)) for p in params]
        for work in works:
            work.wait()
        self.quorum_started = False
        if not self.manager.should_commit():
            error = self.manager.errored()  # this rank's; another group rank's failure shows here as none
            why = f" ({first_line(error.original_exception)})" if error else ""
            logger.warning(
                "step %d not committed across the replica groups%s: training it again", self.trainer.step + 1, why
            )
            return None
        self._save_data_position()
        return {"replica_groups": self.participants, "params_checksum": params_checksum(self.state.params)}

    def _save_data_position(self) -> None:
        partial = f"{self.data_file}.partial"
        torch.save(self.trainer.dataloader.state_dict(), partial)
        os.replace(partial, self.data_file)


class NoReplicaGroups:
    """A run without fault_tolerance.enable: one group, whose steps are always committed."""

    def start_data(self, start: Callable[[str | None], Iterator], resumed: str | None) -> Iterator:
        return start(resumed)

    def average_and_commit(self, params: list[torch.Tensor]) -> dict[str, int]:
        return {}


def join_replica_groups(trainer: Any) -> ReplicaGroups | NoReplicaGroups:
    """The rank's replica groups under ``fault_tolerance.enable``."""
    return ReplicaGroups(trainer) if trainer.config.fault_tolerance.enable else NoReplicaGroups()


def data_share(config: JobConfig) -> tuple[int, int]:
    """(this replica group, the groups): each group trains on its own share of the data."""
    ft = config.fault_tolerance
    return (ft.replica_id, ft.group_size) if ft.enable else (0, 1)

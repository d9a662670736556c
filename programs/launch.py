"""run_train.sh's torchrun: ``python -m programs.launch [torchrun options] train.py [options]``.

What it adds to torchrun:
- A rank that meets a mistake no restart can mend writes "CODE line" to the file named by
  ``TESSERA_ERROR_FILE`` (made here) and exits 0, so that torchrun does not start the group again;
  the line is printed last and the code returned.
- A rank that the kernel killed for want of memory (SIGKILL while the host's count of out-of-memory
  kills rose) is such a mistake too: the same batches would be killed again. The agent writes its
  line, leaves it in torchrun's store for the other nodes, stops the group and ends as a finished
  job would, without a restart; so does an agent whose ranks failed when a line is in the store.
- Stopped by a signal (Ctrl-C, a scheduler's SIGTERM; run_train.sh execs this process, so a signal
  sent to the script's process lands here), the agent stops the ranks and raises an exception:
  here that ends in one line and the shell's exit code for the signal (130 for SIGINT).
- Ranks that failed on every attempt end in torchrun's table of failures, exit code 1, without the
  agent's traceback around it.
- A multi-node job whose rendezvous this host is to serve, on a port another program already
  listens on, is refused in one line (exit 2): torchrun's agent would take that program for the
  rendezvous and wait on it without a word. A listener whose program this user cannot see is
  asked a store's question first, and joined when it answers. A rendezvous that fails (no store
  answering at the endpoint, nodes missing at the deadline) is one line too, exit 2, without the
  agent's retries' C++ stacks and its traceback.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import sys
import tempfile
import threading
from datetime import timedelta


def _stopped_while_starting(signum: int, frame: object) -> None:
    print(f"stopped by {signal.Signals(signum).name} before the ranks started", file=sys.stderr)
    os._exit(128 + signum)


if __name__ == "__main__":
    # Ctrl-C while torch is imported (a second or so), before torchrun's agent takes the signal:
    # one line, not a KeyboardInterrupt traceback. Hence the imports below this.
    signal.signal(signal.SIGINT, _stopped_while_starting)
    # The agent's store client logs each retry of an unanswered rendezvous, and its end, with a C++
    # stack; the failure reaches Python, one line below. Read once, when torch loads: the ranks
    # keep the user's level.
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        import torch  # noqa: F401

        del os.environ["TORCH_CPP_LOG_LEVEL"]

import torch.distributed.launcher.api as launcher_api
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import main as torchrun

from config.errors import first_line, print_error
from trainer.distributed import ERROR_FILE_ENV, adopt_posted_refusal, record_refusal
from trainer.out_of_memory import out_of_memory_error

TORCHRUN_COMMANDS = ("programs.launch", "torch.distributed.run", "torchrun")
"""What a torchrun agent's command line holds: the program another node of the job runs on the
same host (tests, or a node per GPU group), whose rendezvous this one joins."""


def main(argv: list[str]) -> int:
    if holder := _foreign_rendezvous_holder(argv):
        print_error(holder)
        return 2
    descriptor, error_file = tempfile.mkstemp(prefix="tessera-error-")
    os.close(descriptor)
    os.environ[ERROR_FILE_ENV] = error_file  # the ranks inherit it
    launcher_api.LocalElasticAgent = _Agent  # the class torchrun builds its agent from
    try:
        code, failures = _run(argv)
        with open(error_file) as f:
            refusal = f.read().strip()
    finally:
        os.unlink(error_file)
    if refusal:
        refusal_code, line = refusal.split(" ", 1)
        print(line, file=sys.stderr)
        return int(refusal_code)
    if failures:
        print(failures, file=sys.stderr)
    return code


def _run(argv: list[str]) -> tuple[int, str]:
    """torchrun's exit code and its table of failures, if any."""
    try:
        torchrun(argv)
    except SignalException as e:
        print(
            f"stopped by {e.sigval.name}: every rank ended (with checkpoint.enable the same command "
            "resumes from the newest complete checkpoint)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval), ""
    except ChildFailedError as e:
        return 1, e.format_msg()
    except RendezvousError as e:
        endpoint = _rendezvous_endpoint(argv)
        cause = first_line(e.__cause__ or e)
        if isinstance(e, RendezvousConnectionError):
            print_error(
                f"RDZV_ENDPOINT: no rendezvous answered at {endpoint} (is the first node's run_train.sh "
                f"started, and that port open to this node?): {cause}"
            )
        else:
            print_error(f"NNODES: the rendezvous at {endpoint} did not gather the job's nodes: {cause}")
        return 2, ""
    return 0, ""


class _Agent(LocalElasticAgent):
    """torchrun's agent, which also ends the job, without a restart, when a rank was killed for want
    of memory, or when a rank of another node met a mistake no restart can mend."""

    def _start_workers(self, worker_group: WorkerGroup):
        self._oom_kills_at_start = _host_oom_kills()
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if not result.is_failed():
            return result
        store = (worker_group.master_addr, worker_group.master_port)
        if message := self._out_of_memory_kill(result):
            record_refusal(message, store)
        elif not adopt_posted_refusal(store):  # a refusing rank of another node took these down
            return result
        # Ended as a finished job: torchrun neither restarts the group nor leaves before the other
        # nodes do (its store, which this node may host, holds the line for them).
        self._stop_workers(worker_group)
        return RunResult(WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})

    def _out_of_memory_kill(self, result: RunResult) -> str | None:
        killed = sorted(rank for rank, f in result.failures.items() if f.exitcode == -signal.SIGKILL)
        kills = _host_oom_kills()
        if not killed or kills is None or self._oom_kills_at_start is None or kills <= self._oom_kills_at_start:
            return None
        return str(
            out_of_memory_error(
                f"the kernel's out-of-memory killer ended rank {killed[0]} (its host ran out of memory)"
            )
        )


def _foreign_rendezvous_holder(argv: list[str]) -> str | None:
    """When ``--rdzv-endpoint`` names this host and a program other than a torchrun agent listens on
    its port: the line that says so. None otherwise. A listener whose program cannot be seen
    (another user's, or in another PID namespace, as another node's container can be) is joined
    when it answers as torch's store does, refused when it does not."""
    endpoint = _rendezvous_endpoint(argv)
    if endpoint is None:
        return None
    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)  # as torchrun reads it
    if not _is_this_host(host, port):
        return None
    taken = f"RDZV_ENDPOINT: port {port} of this host, where the job's rendezvous is to be, is taken by"
    listening, seen = _listeners(port)
    for pid, command in seen:
        if not any(name in command for name in TORCHRUN_COMMANDS):
            return f"{taken} another program (pid {pid}: {command[:80]}); choose a free port"
    if listening and not seen and not _answers_as_store(host, port):
        return (
            f"{taken} a program this user cannot see, which does not answer as a rendezvous store "
            f"within {STORE_PROBE_SECONDS} s; choose a free port"
        )
    return None


STORE_PROBE_SECONDS = 10
"""How long a listener this user cannot see is given to answer as torch's store (a store answers
in milliseconds)."""


def _answers_as_store(host: str, port: int) -> bool:
    """Whether the program listening on ``host:port`` answers a question to torch's TCPStore. Asked
    from a thread given up after STORE_PROBE_SECONDS: a store client waits on a listener that
    never replies beyond its own timeout."""
    answered = threading.Event()

    def ask() -> None:
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_PROBE_SECONDS))
            store.check(["tessera/probe"])
            answered.set()
        except Exception:  # reset, refused, not a store: no answer
            pass

    threading.Thread(target=ask, name="rendezvous-store-probe", daemon=True).start()
    return answered.wait(STORE_PROBE_SECONDS)


def _rendezvous_endpoint(argv: list[str]) -> str | None:
    """``--rdzv-endpoint``'s value, as run_train.sh passes it (None for a job of one node)."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-endpoint=")), None)


def _is_this_host(host: str, port: int) -> bool:
    """Whether ``host`` is one of this machine's addresses: a socket binds to its own addresses only."""
    try:
        addresses = {info[4][0]: info[0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    for address, family in addresses.items():
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def _listeners(port: int) -> tuple[bool, list[tuple[int, str]]]:
    """Whether a socket listens on TCP ``port`` of this host, and (pid, command line) of each
    process seen holding such a socket (Linux; another user's processes cannot be seen)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        # local address as hex "ADDRESS:PORT", state 0A is LISTEN, the socket's inode in column 9.
        inodes |= {row[9] for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A"}
    if not inodes:
        return False, []
    found = []
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:  # another user's process, or one that has ended
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            pid = int(fd.split("/")[2])
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            found.append((pid, command))
    return True, found


def _host_oom_kills() -> int | None:
    """How many processes the kernel has killed for want of memory since it started (every cgroup's
    kills count), or None where it does not say."""
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The watchdog: names a hung rank and ends the job for torchrun's restart (comm.hang_timeout_seconds),
and names the stragglers among the ranks in the metrics (metrics.straggler_threshold).

Every rank runs a thread beside training that looks at the main thread's Python stack. For hangs it
publishes, to torchrun's store, a heartbeat and a progress mark (step, phase of the step, the stack,
whether that stack waits in a collective); rank 0's thread reads every rank's and judges them, and
rank 1's watches rank 0's heartbeat alone. The judge measures ages on its own clock (when a rank's
heartbeat or mark last changed), so the hosts' clocks need not agree.

For stragglers the thread samples the stack every ``SAMPLE_SECONDS``: the time to a sample in
torch.distributed is time blocked on the peers (a collective's call or wait), to any other busy, less
the time the main thread waited for a core (Linux's schedstat): a crowded host delays a rank without
its work being slower. Collectives make every rank's wall-clock step equal, so wall time cannot tell
the slow rank; the time each spends busy can: the straggler waits least, its peers wait for it. On
GPUs the host blocks at the step's syncs (``.item()``) instead, so the samples see a slow host (data,
Python), not a slow device."""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from config.errors import print_error
from config.job_config import Comm, Metrics
from parallelisms.parallel_dims import ParallelDims
from trainer.distributed import torchrun_store

logger = logging.getLogger(__name__)

HANG_FILE = "hangs.log"  # in job.dump_folder: one line per hang named
PHASES = ("data", "forward/backward", "optimizer", "checkpoint", "validation")
DONE = "done"  # a rank's mark once its training loop ended: no longer judged
SAMPLE_SECONDS = 0.01
DISTRIBUTED_CODE = os.path.dirname(dist.__file__) + os.sep  # torch.distributed's own files
_STACK_FRAMES = 4  # innermost frames a mark carries
_COLLECTIVE_DEPTH = 3


@dataclass
class RankView:
    """What the judge knows of a rank: its last mark and how long ago (judge's clock) it changed."""

    rank: int
    host: str
    pid: int
    step: int
    phase: str
    stack: str
    waiting: bool  # its stack was in torch.distributed
    beat_age: float
    mark_age: float


@dataclass
class Blame:
    ranks: list[RankView]
    why: str


def blame(views: list[RankView], timeout: float, silent_only: bool = False) -> Blame | None:
    """The ranks to name once one is silent or has stayed in one phase longer than ``timeout``; None
    before. A silent rank (heartbeat older than half of it: stopped, frozen, dead) comes first:
    its peers then wait on it in a collective but still beat. Then ranks stuck outside any
    collective, which the others wait on; then ranks behind the others; else all of them.
    ``silent_only``: a rank silent longer than ``timeout``, or none (rank 1's watch of rank 0)."""
    live = [v for v in views if v.phase != DONE and (v.beat_age > timeout or not silent_only)]
    if not any(v.beat_age > timeout or v.mark_age > timeout for v in live):
        return None
    silent = [v for v in live if v.beat_age > timeout / 2]
    if silent:
        return Blame(silent, "silent for {beat_age:.1f} s (stopped, frozen or dead)")
    stuck = [v for v in live if v.mark_age > timeout]
    computing = [v for v in stuck if not v.waiting]
    if computing:
        return Blame(computing, "in this phase for {mark_age:.1f} s, outside any collective")
    first = min(_progress(v) for v in stuck)
    behind = [v for v in stuck if _progress(v) == first]
    if len(behind) < len(stuck):
        return Blame(behind, "in this phase for {mark_age:.1f} s, behind its peers")
    return Blame(stuck, "in this phase for {mark_age:.1f} s, waiting in a collective as every rank named")


def observe(seen: dict[int, tuple], rank: int, mark: dict, now: float) -> RankView:
    """``rank`` as its published ``mark`` and ``seen`` (the judge's record of when its beat and its
    step and phase last changed, which this updates) show it at ``now``."""
    beat, where = mark["beat"], (mark["step"], mark["phase"])
    last_beat, beat_time, last_where, where_time = seen.get(rank, (beat, now, where, now))
    beat_time = now if beat != last_beat else beat_time
    where_time = now if where != last_where else where_time
    seen[rank] = (beat, beat_time, where, where_time)
    fields = (mark[key] for key in ("host", "pid", "step", "phase", "stack", "waiting"))
    return RankView(rank, *fields, beat_age=now - beat_time, mark_age=now - where_time)


def _progress(view: RankView) -> tuple[int, int]:
    return view.step, PHASES.index(view.phase) if view.phase in PHASES else len(PHASES)


def hang_line(found: Blame, timeout: float) -> str:
    """One line naming each blamed rank: host, pid, step, phase, why, and where its stack was."""
    named = "; ".join(
        f"rank {v.rank} on {v.host} (pid {v.pid}) at step {v.step}, {v.phase}, "
        + found.why.format(beat_age=v.beat_age, mark_age=v.mark_age)
        + (f", last in {v.stack}" if v.stack else "")
        for v in found.ranks
    )
    return f"hung: {named} | comm.hang_timeout_seconds {timeout:g}: this rank ends the job for torchrun to restart it"


def straggler_ratios(busy: list[float], stages: list[int], threshold: float) -> dict[int, float]:
    """Rank -> its busy time over the median of its peers' (the other ranks of its pipeline stage,
    which do the same work), for the ranks above ``threshold``; NaN (no samples) counts for none."""
    found = {}
    for rank, mine in enumerate(busy):
        peers = [b for r, b in enumerate(busy) if r != rank and stages[r] == stages[rank] and math.isfinite(b)]
        if not peers or not math.isfinite(mine):
            continue
        median = statistics.median(peers)
        if median > 0 and mine > threshold * median:
            found[rank] = mine / median
    return found


def run_queue_seconds(thread_id: int) -> float:
    """Seconds the thread has waited, runnable, for a core (Linux's schedstat; 0 where there is none)."""
    try:
        with open(f"/proc/self/task/{thread_id}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def in_collective(frame: FrameType | None) -> bool:
    """Whether a stack waits in a collective: one of its innermost ``_COLLECTIVE_DEPTH`` frames is in
    torch.distributed (the wait itself is C++, Work.wait, called from a collective's Python or from
    a helper a call or two below it, as parallelisms/device.py's gathers)."""
    for _ in range(_COLLECTIVE_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_filename.startswith(DISTRIBUTED_CODE):
            return True
        frame = frame.f_back
    return False


def stack_of(frame: FrameType | None) -> str:
    """The innermost frames of a stack, innermost first: ``func (file:line) < caller (file:line) ...``."""
    if frame is None:
        return ""
    frames = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=_STACK_FRAMES, lookup_lines=False)
    return " < ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in frames)


class Watchdog:
    """Built on every rank; ``mark`` says where the training loop is, ``stop`` that it ended. Judging
    and sampling start at the second step's mark: the first step's compilation and warm-up take long
    and differ between ranks."""

    def __init__(self, comm: Comm, metrics: Metrics, dump_folder: str, dims: ParallelDims, device: torch.device):
        self.timeout = comm.hang_timeout_seconds
        self.threshold = metrics.straggler_threshold
        self.dump_folder = dump_folder
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.host = socket.gethostname()
        self.step, self.phase, self.first_step = 0, DONE, None
        self.judging = False
        self.samples, self.busy_seconds = 0, 0.0
        self._main, self._main_thread_id = threading.get_ident(), threading.get_native_id()
        self._last_sample: tuple[float, float] | None = None  # (clock, main thread's run-queue wait)
        self._stopped = threading.Event()
        self._store = None
        if self.timeout > 0 and self.world_size > 1 and "MASTER_ADDR" in os.environ:
            self._store = dist.PrefixStore(
                f"tessera/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/watchdog/",
                torchrun_store(datetime.timedelta(seconds=max(30, self.timeout))),
            )
            self._beats = 0
            self._publish()  # before the first step's collectives: every rank's key is there when judging starts
        self._sampling = self.threshold > 0 and self.world_size > 1
        if self._sampling:
            stage = dims.pp_mesh.get_local_rank() if dims.pp_mesh is not None else 0
            ranks: list = [None] * self.world_size
            dist.all_gather_object(ranks, (stage, self.host))
            self.stages, self.hosts = [r[0] for r in ranks], [r[1] for r in ranks]
        self._thread = threading.Thread(target=self._run, name="tessera-watchdog", daemon=True)
        if self._store is not None or self._sampling:
            self._thread.start()

    def mark(self, phase: str, step: int | None = None) -> None:
        """The main thread enters ``phase`` (of ``step``, or of the step it is in)."""
        if step is not None:
            self.step = step
            self.first_step = self.first_step or step
            self.judging = step > self.first_step
        self.phase = phase

    def stop(self) -> None:
        """The training loop ended: the peers no longer judge this rank, nor this rank them."""
        self.judging = False
        self.phase = DONE
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()  # its last mark is not to follow this one
        if self._store is not None:
            self._publish()

    def stragglers(self) -> list[dict] | None:
        """The ranks busy more than ``metrics.straggler_threshold`` times their peers since the last
        call (a collective: every rank calls it); None when off."""
        if not self._sampling:
            return None
        busy = self.busy_seconds if self.samples else math.nan
        self.samples, self.busy_seconds = 0, 0.0
        gathered = [torch.empty(1, dtype=torch.float64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([busy], dtype=torch.float64, device=self.device))
        ratios = straggler_ratios([t.item() for t in gathered], self.stages, self.threshold)
        return [{"rank": r, "host": self.hosts[r], "busy_ratio": round(ratio, 2)} for r, ratio in ratios.items()]

    def _run(self) -> None:
        interval = min(1.0, max(SAMPLE_SECONDS, self.timeout / 10))
        watched = list(range(self.world_size)) if self.rank == 0 else [0] if self.rank == 1 else []
        seen: dict[int, tuple] = {}
        next_publish = 0.0
        while not self._stopped.wait(SAMPLE_SECONDS if self._sampling else interval):
            if self._sampling and self.judging:  # the first step's warm-up differs between ranks
                self._sample()
            now = time.monotonic()
            if self._store is None or now < next_publish:
                continue
            next_publish = now + interval
            try:
                self._publish()
                if self.judging and watched:
                    self._judge(watched, seen, now)
            except (RuntimeError, OSError) as e:  # torchrun's store went away: the job is ending
                logger.warning("the hang watchdog stops: torchrun's store does not answer (%s)", e)
                self._store = None
                return

    def _sample(self) -> None:
        now, queued = time.monotonic(), run_queue_seconds(self._main_thread_id)
        if self._last_sample is not None and not in_collective(sys._current_frames().get(self._main)):
            clock, queued_before = self._last_sample
            self.busy_seconds += max(0.0, (now - clock) - (queued - queued_before))
        self.samples += 1
        self._last_sample = now, queued

    def _publish(self) -> None:
        frame = sys._current_frames().get(self._main)
        self._beats += 1
        where = {"step": self.step, "phase": self.phase, "stack": stack_of(frame), "waiting": in_collective(frame)}
        del frame  # a frame held by this thread would keep the main thread's locals alive
        mark = {"beat": self._beats} | where
        self._store.set(f"rank_{self.rank}", json.dumps(mark | {"host": self.host, "pid": os.getpid()}))

    def _judge(self, watched: list[int], seen: dict[int, tuple], now: float) -> None:
        """Updates when each watched rank's beat and mark last changed; ends the job on a verdict."""
        keys = [f"rank_{r}" for r in watched]
        views = [observe(seen, rank, json.loads(raw), now) for rank, raw in zip(watched, self._store.multi_get(keys))]
        found = blame(views, self.timeout, silent_only=self.rank != 0)
        if found is not None:
            self._end_job(found)

    def _end_job(self, found: Blame) -> None:
        """Names the ranks on this rank's console and in HANG_FILE, SIGKILLs a silent one on this host
        (a stopped process would hold torchrun's SIGTERM for its 30 s grace), then exits non-zero."""
        line = hang_line(found, self.timeout)
        print_error(line)
        path = os.path.join(self.dump_folder, HANG_FILE)
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
        except OSError as e:  # a full disk, say: the job ends all the same
            logger.warning("cannot write the hang line to %s (%s)", path, e.strerror)
        for view in found.ranks:
            if view.host == self.host and view.beat_age > self.timeout / 2 and view.pid != os.getpid():
                try:
                    os.kill(view.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it died already
        logging.shutdown()
        os._exit(1)

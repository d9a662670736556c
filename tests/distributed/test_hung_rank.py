"""The watchdog (trainer/watchdog.py): a hung rank is named in one line and the job restarts
(comm.hang_timeout_seconds); a rank slower than its peers is named a straggler in the metrics
(metrics.straggler_threshold). First the judge, the straggler ratios and the options (fast), then
launched runs (slow): a rank SIGSTOPped in a step on 4 ranks, and 2-rank runs with and without a
slowed rank."""

from __future__ import annotations

import math
import os
import re
import sys

import pytest

from config.errors import ConfigError
from config.manager import load_config
from tests.launch import TINY_RUN, TWO_BLOCKS, read_metrics, resumed_from, run_script, steps, without_rank_prefixes
from trainer.watchdog import (
    DISTRIBUTED_CODE,
    DONE,
    HANG_FILE,
    RankView,
    blame,
    hang_line,
    in_collective,
    observe,
    stack_of,
    straggler_ratios,
)

TIMEOUT = 5.0


def view(rank: int, *, beat_age=0.2, mark_age=0.2, step=6, phase="forward/backward", waiting=True) -> RankView:
    stack = "broadcast (distributed_c10d.py:1)" if waiting else "before_step (fault_injection.py:1)"
    return RankView(rank, "host", 100 + rank, step, phase, stack, waiting, beat_age, mark_age)


def blamed(views: list[RankView]) -> list[int] | None:
    found = blame(views, TIMEOUT)
    return None if found is None else [v.rank for v in found.ranks]


def test_a_silent_rank_is_blamed_not_its_peers_waiting_on_it():
    # Rank 3 stopped: its peers wait on it in a collective, stuck as long, but they still beat.
    peers = [view(r, mark_age=5.5) for r in range(3)]
    assert blamed([*peers, view(3, beat_age=5.1, mark_age=5.5)]) == [3]
    # It is named once anything is past the timeout, even before its own silence is.
    assert blamed([*peers, view(3, beat_age=3.0, mark_age=5.5)]) == [3]


def test_rank_1_names_rank_0_only_when_it_is_silent():
    # Rank 0 watches every rank; rank 1 watches rank 0, which may be stuck waiting on a third rank.
    assert blame([view(0, mark_age=9)], TIMEOUT, silent_only=True) is None
    assert blame([view(0, beat_age=4, mark_age=9)], TIMEOUT, silent_only=True) is None
    assert [v.rank for v in blame([view(0, beat_age=5.1)], TIMEOUT, silent_only=True).ranks] == [0]


def test_nothing_is_blamed_before_the_timeout():
    assert blamed([view(0, mark_age=4.9), view(1, beat_age=4.9, mark_age=4.9)]) is None


def test_a_rank_stuck_outside_any_collective_is_blamed():
    assert blamed([view(0, mark_age=6), view(1, mark_age=6, waiting=False), view(2, mark_age=6)]) == [1]


def test_the_rank_behind_its_peers_is_blamed():
    # Every rank waits in a collective: the one still in the data phase never joined its peers'.
    ranks = [view(0, mark_age=6), view(1, mark_age=6, phase="data"), view(2, mark_age=6, step=7, phase="data")]
    assert blamed(ranks) == [1]


def test_ranks_waiting_alike_are_all_named():
    assert blamed([view(0, mark_age=6), view(1, mark_age=6)]) == [0, 1]


def test_a_rank_done_training_is_not_judged():
    assert blamed([view(0, beat_age=9, mark_age=9, phase=DONE), view(1, mark_age=1)]) is None


def test_ages_are_measured_on_the_judges_clock():
    seen: dict[int, tuple] = {}
    mark = {"beat": 1, "step": 6, "phase": "data", "stack": "", "waiting": False, "host": "h", "pid": 7}
    observe(seen, 3, mark, now=100.0)
    # Beating on, in the same phase: the mark ages, the heartbeat does not.
    later = observe(seen, 3, mark | {"beat": 2}, now=104.0)
    assert (later.beat_age, later.mark_age) == (0.0, 4.0)
    moved = observe(seen, 3, mark | {"beat": 2, "phase": "forward/backward"}, now=105.5)
    assert (moved.beat_age, moved.mark_age) == (1.5, 0.0)


def test_the_hang_line_names_rank_host_step_phase_and_stack():
    found = blame([view(0, mark_age=6), view(3, beat_age=5.2, mark_age=6, waiting=False)], TIMEOUT)
    line = hang_line(found, TIMEOUT)
    assert "\n" not in line
    assert line.startswith("hung: rank 3 on host (pid 103) at step 6, forward/backward, silent for 5.2 s")
    assert "last in before_step (fault_injection.py:1)" in line
    assert "comm.hang_timeout_seconds 5" in line and "rank 0 " not in line


def test_a_stack_in_torch_distributed_waits_in_a_collective():
    here = sys._getframe()
    assert not in_collective(here)
    assert stack_of(here).startswith("test_a_stack_in_torch_distributed_waits_in_a_collective (")
    # A helper a call below a collective (as parallelisms/device.py's gathers) waits in it too.
    code = compile("def collective(helper):\n    return helper()\n", DISTRIBUTED_CODE + "c10d.py", "exec")
    scope: dict = {}
    exec(code, scope)
    helper = scope["collective"](lambda: sys._getframe())
    assert in_collective(helper)
    assert stack_of(helper).startswith("<lambda> (") and " < collective (c10d.py:2)" in stack_of(helper)


def test_straggler_ratios_against_the_median_of_the_peers():
    assert straggler_ratios([0.3, 0.28, 0.32, 0.9], [0] * 4, 2.0) == {3: pytest.approx(0.9 / 0.3)}
    assert straggler_ratios([0.3, 0.28, 0.32, 0.5], [0] * 4, 2.0) == {}
    # Two ranks: each against the other.
    assert straggler_ratios([0.2, 0.8], [0, 0], 2.0) == {1: pytest.approx(4.0)}
    # Pipeline stages do different work: a rank is compared with its own stage's ranks only.
    assert straggler_ratios([0.2, 0.8, 0.2, 0.8], [0, 1, 0, 1], 2.0) == {}
    # A rank without samples (NaN) is neither named nor a peer.
    assert straggler_ratios([math.nan, 0.2, 0.9], [0] * 3, 2.0) == {2: pytest.approx(4.5)}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--comm.hang_timeout_seconds", "-1"], "comm.hang_timeout_seconds must be >= 0, got -1"),
        (["--metrics.straggler_threshold", "-2"], "metrics.straggler_threshold must be >= 0, got -2"),
        (["--metrics.straggler_threshold", "0.8"], "metrics.straggler_threshold must be 0 (off) or above 1"),
    ],
)
def test_bad_option_values(argv, message):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert message in str(err.value)


STEPS = 8
CHECKPOINTED = [
    *TWO_BLOCKS,
    *("--training.local_batch_size", "2", "--training.steps", str(STEPS)),
    *("--checkpoint.enable", "--checkpoint.interval", "4"),
]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> tuple[str, str]:
    """4 ranks through run_train.sh; the last is SIGSTOPped in step 6's forward/backward, torchrun
    restarts once. Ranks 0 (the judge) and 3 (the stopped one) are shown."""
    dump = str(tmp_path_factory.mktemp("stopped"))
    failure = ("--debug.fail_at_step", "6", "--debug.failure", "stop", "--comm.hang_timeout_seconds", f"{TIMEOUT:g}")
    result = run_script(
        dump, *TINY_RUN, *CHECKPOINTED, *failure, nproc=4, env={"MAX_RESTARTS": "1", "LOG_RANK": "0,3"}, timeout=600
    )
    return dump, without_rank_prefixes(result.stdout + result.stderr)


def _seconds(clock: str) -> int:
    hours, minutes, seconds = map(int, clock.split(":"))
    return hours * 3600 + minutes * 60 + seconds


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_twice_the_timeout(stopped_run):
    dump, output = stopped_run
    lines = [line for line in output.splitlines() if line.startswith("error: hung: ")]
    assert len(lines) == 1, output[-4000:]
    line = lines[0]
    # Rank 3, not its peers waiting on it; where it was: the step, its phase, its Python stack.
    assert re.search(r"hung: rank 3 on \S+ \(pid \d+\) at step 6, forward/backward, silent for [\d.]+ s", line), line
    assert "last in before_step (fault_injection.py:" in line
    assert not re.search(r"rank [012] on", line)
    silent = float(re.search(r"silent for ([\d.]+) s", line).group(1))
    assert silent <= 2 * TIMEOUT
    with open(os.path.join(dump, HANG_FILE)) as f:
        recorded = f.read().splitlines()
    assert [entry.split(" ", 1)[1] for entry in recorded] == [line.removeprefix("error: ")]
    # From the injection (then 1 s to the SIGSTOP) to the line, on the clocks of the two logs (1 s steps).
    injected = re.search(r"^(\d\d:\d\d:\d\d) WARNING .*injecting 'stop' on rank 3$", output, re.MULTILINE).group(1)
    named = recorded[0].split(" ", 1)[0].split("T")[1]
    assert (_seconds(named) - _seconds(injected)) % 86400 <= 2 * TIMEOUT


@pytest.mark.slow
def test_the_job_restarts_and_resumes_from_the_checkpoint(stopped_run):
    dump, output = stopped_run
    assert resumed_from(output) == [4]
    logged = steps(read_metrics(dump))
    assert logged == [*range(1, 6), *range(5, STEPS + 1)], logged


@pytest.fixture(scope="module")
def straggler_runs(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """2 ranks through run_train.sh, 12 steps logged every 4: the last rank slowed from step 2 on
    ("slowed"), or not ("steady"); each run's records and rank 0's log."""
    watched = [*TWO_BLOCKS, "--training.local_batch_size", "2", "--training.steps", "12", "--metrics.log_freq", "4"]
    watched += ["--metrics.straggler_threshold", "2"]
    runs = {"slowed": ["--debug.fail_at_step", "2", "--debug.failure", "slow"], "steady": []}
    found = {}
    for name, failure in runs.items():
        dump = str(tmp_path_factory.mktemp(name))
        result = run_script(dump, *TINY_RUN, *watched, *failure, timeout=600)
        found[name] = (read_metrics(dump), without_rank_prefixes(result.stdout + result.stderr))
    return found


@pytest.mark.slow
def test_a_slowed_rank_is_named_a_straggler(straggler_runs):
    records, log = straggler_runs["slowed"]
    assert steps(records) == [1, 4, 8, 12]
    for record in records[1:]:
        assert [s["rank"] for s in record["stragglers"]] == [1], records
        assert record["stragglers"][0]["busy_ratio"] > 2
    assert "| stragglers rank 1 on " in log


@pytest.mark.slow
def test_a_steady_run_names_no_straggler(straggler_runs):
    records, log = straggler_runs["steady"]
    assert [r["stragglers"] for r in records] == [[]] * 4, records
    assert "stragglers rank" not in log

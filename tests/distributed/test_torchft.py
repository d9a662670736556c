"""Replica groups through torchft (fault_tolerance.enable) on CPU ranks, gloo, one lighthouse on
localhost: two groups of 2 ranks, each its own torchrun; one group's rank is SIGKILLed at a random step,
its torchrun restarts the group, which rejoins by taking the live group's state, while the live group
trains on. One group alone trains as a run without torchft, bitwise. The mistakes of the section, and a
lighthouse that does not answer, are one line and exit 2 before any rank starts."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from programs import preflight
from tests.launch import (
    REPO,
    TINY_RUN,
    TWO_BLOCKS,
    read_metrics,
    resumed_from,
    run_script,
    script_command,
    script_env,
    without_rank_prefixes,
)

GROUPS = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
SMALL = [*TWO_BLOCKS, "--training.local_batch_size", "2"]
REJOINED = "took a live replica group's state"


@pytest.fixture(scope="module")
def lighthouse() -> str:
    """A lighthouse in this process: its address, for TORCHFT_LIGHTHOUSE. A quorum waits 1 s for
    groups that heartbeat but have not asked yet (its default, 60 s, would hold every first step)."""
    os.environ.setdefault("RUST_LOG", "warn")  # its log of every quorum, in this process
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def _workers(torchrun: subprocess.Popen) -> set[int]:
    """The pids of the ranks a torchrun agent runs now."""
    with open(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children") as f:
        return {int(pid) for pid in f.read().split()}


def _text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _records(dump: str) -> list[dict]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _start_group(dump: str, replica: int, lighthouse: str, *overrides: str) -> tuple[subprocess.Popen, str]:
    """One replica group of 2 ranks through run_train.sh, restarted once by its torchrun; both ranks' output
    goes to ``<dump>.log``."""
    log = f"{dump}.log"
    command = script_command(dump, *TINY_RUN, *GROUPS, *SMALL, "--fault_tolerance.replica_id", str(replica), *overrides)
    env = script_env(2, {"TORCHFT_LIGHTHOUSE": lighthouse, "MAX_RESTARTS": "1", "LOG_RANK": "0,1"})
    with open(log, "w") as out:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its ranks end with it
        )
    return process, log


def _step_a_minute_ahead(group: subprocess.Popen, dump: str, log: str) -> int:
    """The step ``group`` will be at a minute from now, at the rate of its logged steps so far."""
    deadline = time.monotonic() + 300
    while len(records := _records(dump)) < 4:
        assert time.monotonic() < deadline and group.poll() is None, _text(log)[-3000:]
        time.sleep(0.5)
    first, last = records[1], records[-1]  # the first step's warm-up left out
    rate = (last["step"] - first["step"]) / max(last["elapsed_s"] - first["elapsed_s"], 1e-3)
    return last["step"] + math.ceil(60 * rate)


@pytest.mark.slow
def test_a_killed_group_rejoins_while_the_other_trains_on(tmp_path, lighthouse):
    steps = ["--training.steps", "100000"]  # stopped once the killed group has trained 5 steps after rejoining
    live, live_log = _start_group(str(tmp_path / "live"), 0, lighthouse, *steps)
    groups = [live]
    killed_at = rejoined_at = None
    try:
        # The other group starts once this one trains and joins at its step: it is killed at a random step
        # a minute of this group's steps ahead (its own start takes 10-30 s), so both train together first.
        kill_step = _step_a_minute_ahead(live, str(tmp_path / "live"), live_log) + random.randint(2, 6)
        live_ranks = _workers(live)  # training: its ranks
        checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "4"]
        killed, killed_log = _start_group(
            str(tmp_path / "killed"), 1, lighthouse, *steps, *checkpoints, "--debug.fail_at_step", str(kill_step)
        )
        groups.append(killed)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and live.poll() is None and killed.poll() is None:
            time.sleep(0.5)
            text = _text(killed_log)
            if killed_at is None and "injecting 'kill'" in text:
                killed_at = time.monotonic()
            if killed_at is not None and rejoined_at is None and REJOINED in text.partition("injecting 'kill'")[2]:
                rejoined_at = time.monotonic()
            after = {r["step"] for r in _records(str(tmp_path / "killed")) if r["step"] > kill_step}
            if rejoined_at is not None and len(after & {r["step"] for r in _records(str(tmp_path / "live"))}) >= 5:
                break
        assert live.poll() is None and killed.poll() is None, _text(live_log)[-3000:] + _text(killed_log)[-3000:]
        # The live group's ranks are the ones it started with.
        assert _workers(live) == live_ranks and len(live_ranks) == 2
    finally:
        for process in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
    assert killed_at is not None and rejoined_at is not None, _text(killed_log)[-4000:]
    assert rejoined_at - killed_at < 60, f"rejoined {rejoined_at - killed_at:.0f} s after the kill"

    live_records, killed_records = _records(str(tmp_path / "live")), _records(str(tmp_path / "killed"))
    live_steps = [r["step"] for r in live_records]
    # Every step once, in order: no gap, never back, no restart.
    assert live_steps == list(range(live_steps[0], live_steps[0] + len(live_steps))), live_steps
    assert "injecting" not in _text(live_log)
    # It trained alone while the other group restarted.
    assert any(r["replica_groups"] == 1 and r["step"] > kill_step for r in live_records), live_records
    by_step = {r["step"]: r for r in live_records}
    rejoin_steps = [r["step"] for r in killed_records if r["step"] > kill_step]
    assert len(rejoin_steps) >= 5 and rejoin_steps[0] > kill_step + 1, [r["step"] for r in killed_records]
    # The weights every step starts from are the same bits in both groups, whenever both trained it (the
    # live group's last step may be unlogged when the test stops it).
    together = [r for r in killed_records if r["replica_groups"] == 2 and r["step"] in by_step]
    assert all(r["params_checksum"] == by_step[r["step"]]["params_checksum"] for r in together), together
    assert len({r["step"] for r in together} & set(rejoin_steps)) >= 5
    # Its data position is its own share's after its last commit, not its checkpoint's: no batch skipped
    # or trained twice. The last commit may have come just before the end, unlogged.
    # Killed in step kill_step, it resumed from its newest checkpoint, saved while both groups trained.
    assert resumed_from(without_rank_prefixes(_text(killed_log))) == [(kill_step - 1) // 4 * 4]
    assert any(r["replica_groups"] == 2 for r in killed_records if r["step"] < kill_step), killed_records
    for rank in range(2):
        position = torch.load(tmp_path / "killed" / "fault_tolerance" / f"data_rank_{rank}.pt", weights_only=False)
        # A group started after the other's first commit joins at its step: it trained fewer steps before the kill.
        before_kill = len({r["step"] for r in killed_records if r["step"] < kill_step})
        assert position["_num_yielded"] - before_kill - len(rejoin_steps) in (0, 1), position


@pytest.mark.slow
def test_one_group_trains_as_a_run_without_torchft(tmp_path, lighthouse):
    run = [*TINY_RUN, *SMALL, "--training.steps", "6"]
    run_script(str(tmp_path / "plain"), *run)
    one_group = [*run, "--fault_tolerance.enable", "--fault_tolerance.group_size", "1"]
    run_script(str(tmp_path / "ft"), *one_group, env={"TORCHFT_LIGHTHOUSE": lighthouse})
    plain, ft = read_metrics(str(tmp_path / "plain")), read_metrics(str(tmp_path / "ft"))
    assert [r["loss"] for r in ft] == [r["loss"] for r in plain] and len(ft) == 6
    assert [r["grad_norm"] for r in ft] == [r["grad_norm"] for r in plain]
    assert {r["replica_groups"] for r in ft} == {1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


NO_LIGHTHOUSE = f"http://localhost:{_free_port()}"
# (options, TORCHFT_LIGHTHOUSE or None for the test's lighthouse, what the one line says)
CASES = [
    (["--fault_tolerance.replica_id", "2"], None, "fault_tolerance.replica_id 2 is not a group of the 2"),
    (["--fault_tolerance.replica_id", "-1"], None, "fault_tolerance.replica_id -1 is not a group of the 2"),
    (["--fault_tolerance.group_size", "0"], None, "fault_tolerance.group_size must be the number of replica groups"),
    (["--fault_tolerance.min_replica_size", "3"], None, "fault_tolerance.min_replica_size 3 must be 1 to the 2"),
    (["--fault_tolerance.semi_sync_method", "diloco"], None, "fault_tolerance.semi_sync_method: 'diloco' is not built"),
    (["--fault_tolerance.process_group", "nccl"], None, "fault_tolerance.process_group: nccl needs CUDA"),
    (["--optimizer.early_step_in_backward"], None, "optimizer.early_step_in_backward: not with fault_tolerance"),
    ([], NO_LIGHTHOUSE, f"TORCHFT_LIGHTHOUSE: no lighthouse answers at localhost:{NO_LIGHTHOUSE.rsplit(':', 1)[1]}"),
    ([], "", "fault_tolerance.enable: set TORCHFT_LIGHTHOUSE=http://host:port of the lighthouse"),
    ([], "localhost", "TORCHFT_LIGHTHOUSE: 'localhost' is not http://host:port of the lighthouse"),
]


@pytest.mark.parametrize("options, address, line", CASES, ids=[c[2].split(":")[0].split(" ")[0] for c in CASES])
def test_a_mistake_is_one_line_before_the_ranks(options, address, line, tmp_path, lighthouse, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse if address is None else address)
    code, err = _preflight(tmp_path, *options)
    errors = [e for e in err.splitlines() if e.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {line}"), err
    assert "Traceback" not in err


def test_torchft_missing_is_one_line_naming_the_install(tmp_path, lighthouse, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    code, err = _preflight(tmp_path)
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: fault_tolerance.enable: torchft is not installed: pip install torchft==0.2.0 "
        "(or pip install -e '.[ft]')"
    ), err


def test_the_options_pass_with_a_lighthouse(tmp_path, lighthouse, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    code, err = _preflight(tmp_path, "--fault_tolerance.replica_id", "1", "--fault_tolerance.min_replica_size", "2")
    assert code == 0, err


def _preflight(tmp_path, *options: str) -> tuple[int, str]:
    """run_train.sh's pre-launch check of a 2-rank group in this process: (exit code, stderr)."""
    err = io.StringIO()
    argv = ["--nnodes", "1", "--nproc-per-node", "2", *TINY_RUN, "--job.dump_folder", str(tmp_path / "run")]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = preflight.main([*argv, *GROUPS, *options])
    return code, err.getvalue()


@pytest.mark.slow
def test_run_train_refuses_a_lighthouse_that_does_not_answer(tmp_path):
    result = run_script(str(tmp_path), *GROUPS, env={"TORCHFT_LIGHTHOUSE": NO_LIGHTHOUSE}, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: TORCHFT_LIGHTHOUSE: no lighthouse answers at localhost:{NO_LIGHTHOUSE.rsplit(':', 1)[1]} "
        "(Connection refused); start one with: torchft_lighthouse --min_replicas 1 --bind [::]:29510 "
        "--join_timeout_ms 1000"
    ]
    assert "process group" not in result.stdout + result.stderr  # no rank started


def test_the_step_line_and_metrics_jsonl_hold_the_quorum_and_the_checksum(tmp_path, caplog):
    from trainer.metrics import MetricsLogger

    values = {"loss": 5.0, "grad_norm": 0.5, "lr": 1e-3, "tps": 100.0, "tflops": 0.1, "mfu": 1.0}
    values |= {"memory_gib": 0.5, "data_loading_pct": 0.1, "replica_groups": 2, "params_checksum": 2**47 + 3}
    logger = MetricsLogger(str(tmp_path), enable=True, enable_tensorboard=False, tensorboard_dir="")
    with caplog.at_level("INFO"):
        logger.log(3, values)
    logger.close()
    assert "| data 0.1% | replica groups 2 | elapsed" in caplog.text
    (record,) = read_metrics(str(tmp_path))
    assert record["replica_groups"] == 2 and record["params_checksum"] == 2**47 + 3

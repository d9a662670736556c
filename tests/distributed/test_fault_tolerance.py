"""Checkpoints and restarts end to end: torchrun restarts after a killed, hung or mid-save rank,
a rank hung inside a save, a disk that fills up during a save, the whole job killed and started
again by hand, a truncated checkpoint, two torchrun agents as two nodes. Every resumed run must
reproduce the uninterrupted run's losses bitwise (``debug.deterministic``, fp32, same layout)."""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from tests.launch import (
    REPO,
    TINY_RUN,
    TWO_BLOCKS,
    kill_tree,
    launch_train,
    losses_by_step,
    read_metrics,
    resumed_from,
    run_script,
    run_train,
    script_command,
    script_env,
    steps,
    train_command,
    train_env,
    unloadable_checkpoints,
)
from trainer.checkpoint.integrity import COMPLETE_MARKER, complete_checkpoints

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

STEPS = 12
# run_train.sh passes configs/debug_model.toml: the direct launches use it too.
CHECKPOINTED = [
    "--job.config_file",
    "configs/debug_model.toml",
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "2",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "4",
    # debug_model.toml's local batch of 8 is 4x the steps' time and adds nothing to a resume.
    *("--training.local_batch_size", "2"),
    *TWO_BLOCKS,
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, dict[int, float]]:
    """The uninterrupted run on 2 ranks (checkpoints at steps 4, 8 and 12)."""
    dump = str(tmp_path_factory.mktemp("reference"))
    return dump, losses_by_step(run_train(dump, 2, *CHECKPOINTED))


def attempts(records: list[dict]) -> list[list[int]]:
    """The steps each attempt logged, from metrics.jsonl (which every attempt appends to): a step
    that does not follow the previous record's starts the next attempt."""
    logged = steps(records)
    starts = [0, *(i for i in range(1, len(logged)) if logged[i] != logged[i - 1] + 1), len(logged)]
    return [logged[a:b] for a, b in zip(starts, starts[1:])]


def assert_resumed(dump: str, output: str, reference: dict[int, float], resumed: list[int]) -> None:
    """The run restarted and resumed from the steps ``resumed``, in order: the first attempt logged
    steps from 1, each later one from the step after its resume point, every step once, up to the
    last; and every logged loss, the first resumed step's included, is the uninterrupted run's
    (the loaded state is the saved one). A restart that started over from step 0 would end on the
    same losses, and fails here."""
    records = read_metrics(dump)
    assert resumed_from(output) == resumed, output[-4000:]
    assert [run[0] - 1 for run in attempts(records)] == [0, *resumed], steps(records)
    assert steps(records)[-1] == STEPS
    assert all(r["loss"] == reference[r["step"]] for r in records), records
    assert unloadable_checkpoints(dump) == []


def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path, reference):
    # The acceptance scenario through run_train.sh (its --max-restarts default).
    result = run_script(
        str(tmp_path), *TINY_RUN, *CHECKPOINTED, "--debug.fail_at_step", "7", env={"LOG_RANK": "0,1"}, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "injecting 'kill'" in output
    assert_resumed(str(tmp_path), output, reference[1], [4])


def test_crash_in_the_middle_of_an_async_save(tmp_path, reference):
    result = launch_train(
        str(tmp_path),
        2,
        *CHECKPOINTED,
        "--checkpoint.async_mode",
        "async",
        "--debug.fail_at_step",
        "8",
        "--debug.failure",
        "kill_during_save",
        max_restarts=1,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert "killing this rank in the middle of the save" in output
    # The half-written step-8 is not loaded: the restart goes back to step 4 and drops it.
    assert "removing incomplete checkpoint" in output
    assert_resumed(str(tmp_path), output, reference[1], [4])


def test_hung_rank_times_out_and_restarts(tmp_path, reference):
    result = launch_train(
        str(tmp_path),
        2,
        *CHECKPOINTED,
        "--debug.fail_at_step",
        "6",
        "--debug.failure",
        "hang",
        "--comm.train_timeout_seconds",
        "5",
        max_restarts=1,
        timeout=900,
    )
    output = result.stdout + result.stderr
    traces = os.path.join(str(tmp_path), "comm_traces")
    line = next(line for line in output.splitlines() if "error: a collective failed at step 6" in line)
    # Rank 0 timed out in a gather, waiting for rank 1 (which hung): its flight recorder's last
    # collective is one of FSDP2's gathers (broadcasts on gloo), which the line names.
    with open(os.path.join(traces, "rank_0"), "rb") as f:
        last = pickle.load(f)["entries"][-1]
    assert last["profiling_name"] == "gloo:broadcast"
    assert any(frame["name"] == "foreach_all_gather" for frame in last["frames"])
    assert (
        f"the ranks' last collectives are in {traces} (this rank's last: gloo:broadcast #{last['collective_seq_id']} of default_pg)"
        in line
    )
    assert_resumed(str(tmp_path), output, reference[1], [4])


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _logged_steps(dump: str) -> int:
    metrics = os.path.join(dump, "metrics.jsonl")
    return sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0


def test_five_sigkills_at_random_steps(tmp_path, reference):
    """Kills a random rank from outside five times, each after 1-3 newly logged steps and once a
    complete checkpoint exists, so that every restart must resume from one; with
    ``--max-restarts 5`` a single failed rendezvous would exhaust the restarts."""
    rng = random.Random(1234)
    dump = str(tmp_path)
    command = train_command(
        dump,
        2,
        *CHECKPOINTED,
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.keep_latest_k",
        "2",
        max_restarts=5,
    )
    log = open(tmp_path / "agent.log", "w")
    # LOGLEVEL=INFO: torchrun logs each start of the group with its restart count.
    agent = subprocess.Popen(command, cwd=REPO, env=train_env({"LOGLEVEL": "INFO"}), stdout=log, stderr=log)
    metrics = os.path.join(dump, "metrics.jsonl")

    def logged() -> int:
        return sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0

    killed = []
    try:
        for kill in range(5):
            target = logged() + rng.randint(1, 3)
            deadline = time.monotonic() + 300
            while logged() < target or not complete_checkpoints(os.path.join(dump, "checkpoint")):
                assert agent.poll() is None, f"the job ended before kill {kill + 1}"
                assert time.monotonic() < deadline, f"no progress before kill {kill + 1}"
                time.sleep(0.05)
            group = _children(agent.pid)
            killed.append((rng.choice(group), group))
            os.kill(killed[-1][0], 9)
        assert agent.wait(timeout=600) == 0, (tmp_path / "agent.log").read_text()[-4000:]
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    output = (tmp_path / "agent.log").read_text()
    # Each failure torchrun reports is in the group we had just hit: the process we killed, dead of
    # SIGKILL, or its peer, when the peer's own error (connection closed) is timestamped first.
    failed = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)", output)
    assert len(failed) == len(killed), (failed, killed)
    for (exitcode, pid), (victim, group) in zip(failed, killed):
        assert int(pid) in group and (int(pid) != victim or exitcode == "-9"), (failed, killed)
    assert_restarted_after_each_kill(output, read_metrics(dump), reference[1], restarts=5)
    complete = [p for p in os.listdir(os.path.join(dump, "checkpoint")) if p.startswith("step-")]
    assert len(complete) <= 2, complete  # keep_latest_k
    assert unloadable_checkpoints(dump) == []


def assert_restarted_after_each_kill(output: str, records: list[dict], reference: dict[int, float], restarts: int):
    """From torchrun's log and rank 0's lines in it: the group failed and was started again
    ``restarts`` times; each restarted attempt resumed from a checkpoint (a start from step 0 ends
    on the same losses, and fails here) no older than the newest one saved before (and from no step
    it had not reached), logged every step from there once, and every logged loss is the
    uninterrupted run's."""
    assert [int(n) for n in re.findall(r"restart_count=(\d+)", output)] == list(range(restarts + 1)), output[-4000:]
    failures = re.findall(r"Worker group FAILED\. (\d+)/\d+ attempts left", output)
    assert [int(n) for n in failures] == list(range(restarts, 0, -1)), output[-4000:]
    # The log of attempt i runs from its rendezvous to the next one's.
    sections = re.split(r"restart_count=\d+", output)[1:]
    saved, logged_by_attempt = 0, []
    for i, section in enumerate(sections):
        resumed = resumed_from(section)
        assert len(resumed) == (1 if i else 0), (i, section[-4000:])
        start = resumed[0] if i else 0
        logged = [int(n) for n in re.findall(rf"\bstep (\d+)/{STEPS} \(", section)]
        assert logged == list(range(start + 1, start + 1 + len(logged))) and logged, (i, start, logged)
        if i:
            assert saved <= start <= logged_by_attempt[-1][-1], (i, saved, start, logged_by_attempt[-1])
        saved = max([saved, *(int(n) for n in re.findall(r"checkpoint saved: \S*step-(\d+)", section))])
        logged_by_attempt.append(logged)
    assert logged_by_attempt[-1][-1] == STEPS
    # metrics.jsonl holds the same records, attempt after attempt.
    assert steps(records) == [step for logged in logged_by_attempt for step in logged]
    assert all(r["loss"] == reference[r["step"]] for r in records), records


def test_truncated_newest_checkpoint_falls_back(tmp_path, reference):
    dump = str(tmp_path / "run")
    shutil.copytree(reference[0], dump)
    os.remove(os.path.join(dump, "metrics.jsonl"))
    newest = os.path.join(dump, "checkpoint", "step-12")
    shard = os.path.join(newest, "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(1000)
    # Asked for explicitly: a one-line error naming the option and the file.
    result = launch_train(dump, 2, *CHECKPOINTED, "--checkpoint.load_step", "12", check=False)
    assert result.returncode != 0
    assert f"error: checkpoint.load_step 12: {shard} is truncated or changed" in result.stderr
    # Auto-resume: step 8 instead (steps 9-12 logged once each), then the same losses.
    result = launch_train(dump, 2, *CHECKPOINTED)
    assert resumed_from(result.stdout + result.stderr) == [8]
    records = read_metrics(dump)
    assert steps(records) == [9, 10, 11, 12]
    assert losses_by_step(records) == {step: loss for step, loss in reference[1].items() if step > 8}
    assert unloadable_checkpoints(dump) == ["step-12.unloadable"]


def test_a_finished_run_started_again_says_there_is_nothing_left(tmp_path, reference):
    dump = str(tmp_path / "run")
    shutil.copytree(reference[0], dump)
    result = run_script(dump, *TINY_RUN, *CHECKPOINTED, env={"LOG_RANK": "0,1"})
    output = result.stdout + result.stderr
    warning = f"resumed at step {STEPS}, the run's end (training.steps {STEPS}): nothing left to train"
    assert output.count(warning) == 2, output[-3000:]  # one line per rank
    assert steps(read_metrics(dump)) == steps(read_metrics(reference[0]))  # no step logged again


def test_a_job_of_another_model_is_refused_without_a_restart(tmp_path, reference):
    """Started again on the dump folder with one block more: one line naming the checkpoint and
    how the models differ, exit 2, no restart, the checkpoints left as they were (each failed to
    load before, was moved aside as unloadable, and training began again at step 1)."""
    dump = str(tmp_path / "run")
    shutil.copytree(reference[0], dump)
    before = sorted(os.listdir(os.path.join(dump, "checkpoint")))
    result = run_script(dump, *TINY_RUN, *CHECKPOINTED, "--model.n_layers", "3", check=False)
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, output[-4000:]
    assert errors == [
        f"error: checkpoint.folder: {dump}/checkpoint/step-12 holds another model than this job's: 9 tensors "
        "it lacks (layers.2.attention_norm.weight, layers.2.attention.wq.weight, ...)"
    ], output[-4000:]
    assert "Traceback" not in output and "Restarting" not in output
    assert sorted(os.listdir(os.path.join(dump, "checkpoint"))) == before


def test_a_job_whose_data_does_not_fit_the_saved_position_is_refused(tmp_path, reference):
    """Started again with a local batch of 5: the saved data position (sample 48, after 12 steps of
    4) is where no batch of 10 begins. One line saying how to go on, exit 2, no restart (it was a
    traceback in every one of torchrun's attempts). A batch that does begin there, as twice the
    batch's does, resumes: no sample is lost or read twice."""
    dump = str(tmp_path / "run")
    shutil.copytree(reference[0], dump)
    result = run_script(dump, *TINY_RUN, *CHECKPOINTED, "--training.local_batch_size", "5", check=False)
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, output[-4000:]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint.folder: the data position saved in {dump}/checkpoint/step-12 does not fit this job: "
        "data state is at sample 48 of batches of 4, where no batch of this loader's 10"
    ), output[-4000:]
    assert errors[0].endswith("or start the data over with --checkpoint.exclude_from_loading dataloader")
    assert "Traceback" not in output and "Restarting" not in output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost(tmp_path, reference):
    """Two torchrun agents with one rank each, joined by the c10d rendezvous, train as the
    reference's two ranks do."""
    env = script_env(1, {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}", "RDZV_ID": "two-nodes"})
    dump = str(tmp_path)
    nodes = [
        subprocess.Popen(
            script_command(dump, *TINY_RUN, *CHECKPOINTED),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    assert losses_by_step(read_metrics(dump)) == reference[1]


def _two_nodes(commands: list[list[str]], rdzv_id: str, timeout: float) -> list[tuple[int, str]]:
    """Runs two run_train.sh nodes of one rank each on this host; each node's exit code and output."""
    env = script_env(1, {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}", "RDZV_ID": rdzv_id})
    nodes = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in commands
    ]
    try:
        outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node)
    return [(node.returncode, output) for node, output in zip(nodes, outputs)]


def test_a_mistake_on_one_node_ends_every_node_in_its_line(tmp_path):
    """Two nodes; the rank of one runs out of memory (injected). Both scripts end with its line and
    exit code 2, without a restart. Before, the other node's rank saw only a broken collective and
    exited 1, so its agent waited for a new rendezvous that the finished node never joined, and the
    finished node's agent waited for it at torchrun's exit barrier: minutes, then failures."""
    oom = ["--debug.fail_at_step", "2", "--debug.failure", "oom", "--lr_scheduler.warmup_steps", "1"]
    command = script_command(str(tmp_path), *TINY_RUN, *oom)
    results = _two_nodes([command, command], "refusal", timeout=240)
    line = "error: training.local_batch_size: out of memory in step 2 on rank 1 (debug.failure=oom injected on rank 1)"
    for code, output in results:
        assert code == 2, output[-3000:]
        assert output.rstrip().splitlines()[-1].startswith(line), output[-3000:]
        assert "Restarting" not in output, output[-3000:]


def test_rank_hung_inside_a_save_times_out_and_restarts(tmp_path, reference):
    """The last rank hangs once its shard of step 8 is written: rank 0 waits in the save's
    collective for comm.train_timeout_seconds, fails naming step-8, torchrun restarts, step 4
    resumes."""
    dump = str(tmp_path)
    command = train_command(
        dump,
        2,
        *CHECKPOINTED,
        "--debug.fail_at_step",
        "8",
        "--debug.failure",
        "hang_during_save",
        "--comm.train_timeout_seconds",
        "10",
        max_restarts=1,
    )
    agent = subprocess.Popen(
        command, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output = agent.communicate(timeout=600)[0]
    finally:
        if agent.poll() is None:
            kill_tree(agent)  # the ranks too: they are not in the agent's process group
    assert agent.returncode == 0, output[-4000:]
    step_8 = os.path.join(dump, "checkpoint", "step-8")
    assert "this rank hangs in the middle of the save" in output
    # The save's own group waited comm.train_timeout_seconds, not torch's default of 30 minutes.
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    expected = f"error: saving {step_8} failed: RuntimeError: "
    assert len(errors) == 1 and errors[0].startswith(expected) and "Timed out waiting 10000ms" in errors[0], errors
    assert "resumed from step 4" in output and f"removing incomplete checkpoint {step_8}" in output
    assert losses_by_step(read_metrics(dump)) == reference[1]


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, reference):
    """The disk fills up while the last rank writes step 8: the run ends with one line naming
    step-8, which has no marker; the same run started again drops it and resumes from step 4."""
    dump = str(tmp_path)
    full = ["--debug.fail_at_step", "8", "--debug.failure", "disk_full_during_save"]
    result = launch_train(dump, 2, *CHECKPOINTED, *full, check=False)
    step_8 = os.path.join(dump, "checkpoint", "step-8")
    assert result.returncode != 0
    # Every rank ends with the same line (DCP shares a rank's failure), and no DCP traceback.
    errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}
    expected = f"error: saving {step_8} failed on rank 1: OSError: [Errno 28] No space left on device: "
    assert len(errors) == 1 and next(iter(errors)).startswith(expected), result.stderr[-4000:]
    assert "CheckpointException" not in result.stderr
    assert os.path.isdir(step_8) and not os.path.exists(os.path.join(step_8, COMPLETE_MARKER))
    assert [step for step, _ in complete_checkpoints(os.path.join(dump, "checkpoint"))] == [4]

    result = launch_train(dump, 2, *CHECKPOINTED)
    output = result.stdout + result.stderr
    assert f"removing incomplete checkpoint {step_8}" in output and "resumed from step 4" in output
    assert losses_by_step(read_metrics(dump)) == reference[1]


def test_whole_job_killed_and_started_again_by_hand(tmp_path, reference):
    """SIGKILL to torchrun and its ranks together after step 6 is logged, then the same command
    again: it resumes from the newest complete checkpoint and ends as the uninterrupted run."""
    dump = str(tmp_path)
    command = train_command(dump, 2, *CHECKPOINTED)
    with open(tmp_path / "killed.log", "w") as log:
        agent = subprocess.Popen(command, cwd=REPO, env=train_env(), stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 600
            while _logged_steps(dump) < 6:
                assert agent.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "no step 6 within 600 s"
                time.sleep(0.05)
        finally:
            kill_tree(agent)
    assert agent.returncode == -signal.SIGKILL
    newest = complete_checkpoints(os.path.join(dump, "checkpoint"))[0][0]
    assert 4 <= newest < STEPS

    result = launch_train(dump, 2, *CHECKPOINTED)
    assert f"resumed from step {newest}" in result.stdout + result.stderr
    assert losses_by_step(read_metrics(dump)) == reference[1]


def test_a_fine_tune_restarted_by_torchrun_trains_as_the_uninterrupted_one(tmp_path, reference):
    """A job started from another run's checkpoint without its optimizer, data position and step
    (exclude_from_loading): torchrun's restart after a killed rank loads the launch's own newest
    checkpoint whole, through run_train.sh and under torchrun alone, and every loss is the
    uninterrupted job's (before, the restart left those parts out of it again: the data read again
    from the start and the optimizer reset, mid-run)."""
    start = os.path.join(reference[0], "checkpoint", "step-4")
    fine_tune = [*CHECKPOINTED, "--checkpoint.initial_load_path", start, "--checkpoint.initial_load_model_only=false"]
    fine_tune += ["--checkpoint.exclude_from_loading", "optimizer,dataloader,train_state", "--metrics.log_freq", "1"]
    uninterrupted = run_script(str(tmp_path / "uninterrupted"), *fine_tune)
    assert resumed_from(uninterrupted.stdout + uninterrupted.stderr) == []
    expected = losses_by_step(read_metrics(str(tmp_path / "uninterrupted")))
    assert expected[1] != reference[1][5]  # step 1 trains on the data's first batch, not step 5's
    killed = ["--debug.fail_at_step", "7"]
    result = run_script(str(tmp_path / "killed"), *fine_tune, *killed, env={"LOG_RANK": "0,1"}, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "injecting 'kill'" in output, output[-4000:]
    assert resumed_from(output) == [4]
    assert losses_by_step(read_metrics(str(tmp_path / "killed"))) == expected
    # torchrun alone, without run_train.sh's launcher (and with TINY_RUN's shape): the restart goes
    # on from step 4 and its steps 5 and 6 repeat the first attempt's bitwise (the data read again
    # from the start gave other losses).
    result = launch_train(str(tmp_path / "torchrun"), 2, *fine_tune, *killed, max_restarts=1)
    output = result.stdout + result.stderr
    assert "injecting 'kill'" in output and resumed_from(output) == [4], output[-4000:]
    records = read_metrics(str(tmp_path / "torchrun"))
    assert attempts(records) == [list(range(1, 7)), list(range(5, STEPS + 1))]
    first, restarted = records[4:6], records[6:8]
    assert [r["loss"] for r in first] == [r["loss"] for r in restarted]

"""run_train.sh end to end: 2 CPU ranks, the default corpus and tokenizer, real output files."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from programs import preflight
from tests.launch import REPO, TINY_RUN, TWO_BLOCKS, losses, read_metrics, run_script, script_command, script_env

pytestmark = pytest.mark.slow  # every test here launches torchrun / run_train.sh

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib"}


# Generous: full run_train.sh launches (the default corpus, and Inductor in the second test).
TIMEOUT = 1500


def test_run_train_30_steps(tmp_path):
    dump = str(tmp_path / "run")
    result = run_script(
        dump,
        *("--training.steps", "30", "--training.seq_len", "128", "--job.run_name", "e2e"),
        *("--job.save_config_file", "saved/job_config.json"),
        timeout=TIMEOUT,
    )

    records = read_metrics(dump)
    assert [r["step"] for r in records] == [1, 10, 20, 30]
    for record in records:
        assert METRIC_KEYS <= set(record)
        assert record["tps"] > 0 and record["memory_gib"] > 0
    assert losses(records)[-1] < 0.9 * losses(records)[0]

    events = EventAccumulator(os.path.join(dump, "tb", "e2e"))
    events.Reload()
    loss_events = events.Scalars("loss/global_avg")
    assert [e.step for e in loss_events] == [1, 10, 20, 30]
    # TensorBoard stores float32.
    assert [e.value for e in loss_events] == [float(np.float32(r["loss"])) for r in records]

    # The run's own config.toml goes back in as the config of a rerun in the same folder (a
    # user's file of that name there is refused: the run would overwrite it).
    resolved = os.path.join(dump, "config.toml")
    assert preflight.main(["--nnodes", "1", "--nproc-per-node", "2", "--job.config_file", resolved]) == 0
    with open(os.path.join(dump, "saved", "job_config.json")) as f:
        saved = json.load(f)  # torchtitan's job.save_config_file: the resolved config as JSON
    assert (saved["training"]["steps"], saved["job"]["run_name"], saved["compile"]["components"]) == (
        30,
        "e2e",
        ["model", "loss"],
    )
    # Rank 0's console line carries the step's metrics, then the run's summary says where things went.
    output = result.stdout + result.stderr
    assert "step 30/30 (100%) | loss " in output
    assert "training finished at step 30/30" in output and "  wall time   " in output
    assert f"  metrics     {os.path.join(dump, 'metrics.jsonl')}" in output
    assert f"  tensorboard {os.path.join(dump, 'tb', 'e2e')}" in output


def test_simple_fsdp_compiled_auto_tracks_fsdp2(tmp_path):
    """The SimpleFSDP acceptance run: inductor, auto bucketing, 10 steps, against FSDP2 eager; under
    activation_checkpoint.mode memory_budget 0.3, whose partitioner must size the process groups that
    Inductor's graphs hold as script objects (test_compile_composition.py counts what a budget
    recomputes). Two blocks: Inductor's C++ compile time grows with the graph."""
    common = ["--training.steps", "10", "--training.seq_len", "128", "--metrics.log_freq", "1", *TWO_BLOCKS]
    common += ["--metrics.enable_tensorboard", "false"]
    run_script(str(tmp_path / "fsdp2"), *common, timeout=TIMEOUT)
    simple = [
        *common,
        *("--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable", "--compile.bucketing", "auto"),
        *("--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.3"),
    ]
    output = run_script(str(tmp_path / "simple"), *simple, timeout=TIMEOUT)
    assert "SimpleFSDP auto bucket plan" in output.stdout + output.stderr
    expected = losses(read_metrics(str(tmp_path / "fsdp2")))
    got = losses(read_metrics(str(tmp_path / "simple")))
    assert len(got) == len(expected) == 10
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: {a} vs {b}"


def test_paths_are_read_from_where_the_script_is_started(tmp_path):
    """Started from another folder, the script reads the config file and the options' relative
    paths from there, as torchrun would, and writes the run there (it read them from its own
    folder: a corpus next to the user's config was not found, and outputs landed in the checkout)."""
    (tmp_path / "job.toml").write_text('[job]\ndump_folder = "out"\n[training]\nsteps = 3\nseq_len = 64\n')
    (tmp_path / "corpus.txt").write_text("A sentence of the user's own corpus. " * 2000)
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "CONFIG_FILE": "job.toml"}
    result = subprocess.run(
        [
            os.path.join(REPO, "run_train.sh"),
            "--training.dataset_path",
            "corpus.txt",
            "--lr_scheduler.warmup_steps",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert [r["step"] for r in read_metrics(str(tmp_path / "out"))] == [1, 3]


@pytest.mark.parametrize("to_whole_group", [True, False], ids=["ctrl_c", "sigterm_to_the_script"])
def test_a_signal_stops_every_rank_in_one_line(tmp_path, to_whole_group):
    """Ctrl-C in the terminal (SIGINT to the script's whole process group), or a scheduler's SIGTERM
    to the script's process alone, ends the ranks and torchrun with one line and the shell's code
    for the signal, leaving no process behind. Before, Ctrl-C printed a rank's KeyboardInterrupt
    traceback and torchrun's SignalException traceback, and SIGTERM ended the script alone, with
    torchrun and the ranks training on."""
    dump = str(tmp_path / "run")
    log = open(tmp_path / "output.txt", "w+")
    command = script_command(dump, "--training.steps", "1000", "--training.seq_len", "64", "--metrics.log_freq", "1")
    # Its own process group, as a terminal gives a foreground job.
    script = subprocess.Popen(
        command, cwd=REPO, env=script_env(2), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + TIMEOUT
    while not (os.path.isfile(os.path.join(dump, "metrics.jsonl")) and read_metrics(dump)):
        assert script.poll() is None and time.monotonic() < deadline, "the run ended or never logged a step"
        time.sleep(0.5)
    sent = signal.SIGINT if to_whole_group else signal.SIGTERM
    if to_whole_group:
        os.killpg(script.pid, sent)
    else:
        os.kill(script.pid, sent)
    code = script.wait(timeout=120)
    log.seek(0)
    output = log.read()
    assert code == 128 + sent, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    stopped = f"stopped by {sent.name}: every rank ended (with checkpoint.enable the same command resumes from"
    assert output.rstrip().splitlines()[-1].startswith(stopped), output[-3000:]
    time.sleep(1)
    with pytest.raises(ProcessLookupError):
        os.killpg(script.pid, 0)  # nothing of the group is left


def test_ctrl_c_while_the_launcher_imports_torch_is_one_line():
    """Ctrl-C in the second or so the launcher spends importing torch, after the pre-launch check
    and before torchrun's agent takes the signal: one line and code 130 (a KeyboardInterrupt
    traceback before)."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "programs.launch", "--standalone", "--nproc-per-node=1", "train.py"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)  # python is up, torch not yet imported (about 1.3 s here)
    launcher.send_signal(signal.SIGINT)
    _, stderr = launcher.communicate(timeout=60)
    assert (launcher.returncode, stderr) == (130, "stopped by SIGINT before the ranks started\n")


def test_ranks_that_fail_every_attempt_end_in_torchruns_table(tmp_path):
    """A rank killed with no restarts left: exit code 1 and torchrun's table of failures naming the
    rank and its signal, without the agent's Python traceback around it."""
    kill = ["--debug.fail_at_step", "3", "--debug.failure", "kill", "--lr_scheduler.warmup_steps", "1"]
    result = run_script(str(tmp_path / "run"), *TINY_RUN, *kill, env={"MAX_RESTARTS": "0"}, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "train.py FAILED" in output and "Root Cause (first observed failure)" in output, output[-3000:]
    assert "(SIGKILL)" in output and "Traceback" not in output, output[-3000:]

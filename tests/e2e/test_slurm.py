"""scripts/slurm_train.sh under a stand-in SLURM: ``scontrol`` names two nodes, ``srun`` records
what it was asked and runs the command as on the first node, and the interpreter records the
torchrun command line instead of starting torchrun (the pre-launch check runs for real)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launch import REPO

SCRIPT = os.path.join(REPO, "scripts", "slurm_train.sh")

# One write per host, the second after a pause, as scontrol writes a long list in pieces: a reader
# that stops after the first line makes the second write fail (SIGPIPE).
FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "$SLURM_JOB_NODELIST" ] || exit 1
echo gpu-node-07
sleep 0.5
echo gpu-node-08
"""

# One task per node: record the options, the environment the script exported and the folder, then
# run the command (what srun does on each node).
FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun_args"
echo "NNODES=$NNODES RDZV_ENDPOINT=$RDZV_ENDPOINT RDZV_ID=$RDZV_ID" > "$FAKE_DIR/srun_env"
pwd > "$FAKE_DIR/srun_cwd"
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""

FAKE_PYTHON = f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m programs.launch" ]; then
  shift 2
  printf '%s\\n' "$@" > "$FAKE_DIR/torchrun_args"
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS" > "$FAKE_DIR/torchrun_env"
  exit 0
fi
exec {sys.executable} "$@"
"""


def test_slurm_script_parses():
    result = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _fake_tools(folder) -> dict[str, str]:
    for name, text in (
        ("scontrol", FAKE_SCONTROL),
        ("srun", FAKE_SRUN),
        ("python", FAKE_PYTHON),
    ):
        path = folder / name
        path.write_text(text)
        path.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(folder / "python")}


def _lines(path) -> list[str]:
    return path.read_text().splitlines()


@pytest.mark.slow  # runs run_train.sh (its pre-launch check imports torch)
def test_slurm_script_runs_one_torchrun_agent_per_node(tmp_path):
    env = dict(os.environ, FAKE_DIR=str(tmp_path), **_fake_tools(tmp_path))
    env.update(SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242")
    env.update(SLURM_SUBMIT_DIR=REPO)  # sbatch runs a copy of the script from its spool folder
    env.pop("NGPU", None)
    env.pop("OMP_NUM_THREADS", None)
    env["RDZV_PORT"] = "29611"
    result = subprocess.run(
        ["bash", SCRIPT, "--training.steps", "1000"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr

    endpoint = "gpu-node-07:29611"  # the first node of the allocation
    srun_options = [
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
    ]  # one agent a node, whatever sbatch had
    assert _lines(tmp_path / "srun_args") == [*srun_options, "./run_train.sh", "--training.steps", "1000"]
    assert _lines(tmp_path / "srun_env") == [f"NNODES=2 RDZV_ENDPOINT={endpoint} RDZV_ID=tessera-4242"]
    assert _lines(tmp_path / "srun_cwd") == [REPO]
    # The pre-launch check found no accelerator: 2 CPU ranks per node, one thread each.
    assert _lines(tmp_path / "torchrun_args") == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=tessera-4242",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--local-ranks-filter",
        "0",
        "--role",
        "rank",
        "--tee",
        "3",
        os.path.join(REPO, "train.py"),
        "--job.config_file",
        os.path.join(REPO, "configs", "debug_model.toml"),
        "--training.steps",
        "1000",
    ]
    assert _lines(tmp_path / "torchrun_env") == ["OMP_NUM_THREADS=1"]


def test_the_script_outside_an_allocation_is_one_line(tmp_path):
    """``bash scripts/slurm_train.sh`` on a login node, not through sbatch: bash's unbound-variable
    message and exit code 1."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    result = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        ["error: SLURM_JOB_ID is not set: submit this script with sbatch (./run_train.sh trains on this node alone)"],
    )


@pytest.mark.parametrize("port", ["abc", "0", "70000"])
def test_a_bad_rdzv_port_is_one_line_naming_it(tmp_path, port):
    """It named RDZV_ENDPOINT, which the script makes from it (run_train.sh's check)."""
    env = dict(os.environ, FAKE_DIR=str(tmp_path), RDZV_PORT=port, **_fake_tools(tmp_path))
    env.update(SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242")
    env.update(SLURM_SUBMIT_DIR=REPO)
    result = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [f"error: RDZV_PORT: '{port}' is not a port (1 to 65535)"],
    )


def test_a_job_submitted_from_another_folder_is_one_line(tmp_path):
    """sbatch from the home folder, say: srun could not start ./run_train.sh on any node."""
    env = dict(os.environ, FAKE_DIR=str(tmp_path), **_fake_tools(tmp_path))
    env.update(SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242")
    env.update(SLURM_SUBMIT_DIR=str(tmp_path))
    result = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [
            f"error: SLURM_SUBMIT_DIR: {tmp_path} has no run_train.sh; submit the job from Tessera's folder "
            "(sbatch scripts/slurm_train.sh there)"
        ],
    )
    assert not (tmp_path / "srun_args").exists()


@pytest.mark.slow  # runs run_train.sh (its pre-launch check imports torch)
def test_a_job_of_one_node_is_started_alone_without_a_warning(tmp_path):
    """sbatch --nodes 1: the script set RDZV_ENDPOINT, and run_train.sh warned that it was set but
    NNODES was 1, asking for NNODES."""
    env = dict(os.environ, FAKE_DIR=str(tmp_path), **_fake_tools(tmp_path))
    env.update(SLURM_JOB_NODELIST="gpu-node-07", SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="4242")
    env.update(SLURM_SUBMIT_DIR=REPO, NGPU="2")
    for name in ("RDZV_ENDPOINT", "RDZV_ID", "RDZV_PORT"):
        env.pop(name, None)
    result = subprocess.run(
        ["bash", SCRIPT, "--training.steps", "1000"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert _lines(tmp_path / "torchrun_args")[:2] == ["--standalone", "--nproc-per-node=2"]

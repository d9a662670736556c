"""Runs train.py the way users do (torchrun, gloo on CPU) and reads back what it logged."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from parallelisms.device import memory_cgroup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = "train.py"
# train.py's run, then one "REPORT {json}" line per rank saying what was compiled.
TRAIN_AND_REPORT = os.path.join("tests", "distributed", "train_and_report.py")

# Small and quick: what every launched test run shares unless it overrides it.
TINY_RUN = [
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "64",
    "--training.steps",
    "10",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_flops",
    "1e12",
    "--debug.deterministic",
    # Parity tests compare bitwise, which only float32 allows; bf16 runs ask for it.
    "--training.mixed_precision_param",
    "float32",
]
# Two blocks instead of the debug model's six, for tests whose property does not depend on depth
# (parity between layouts, bitwise resumes): the steps' compute is most of a batched run's time.
TWO_BLOCKS = ["--model.n_layers", "2"]
# Four for the pipeline runs: two one-block stages per rank on 2 ranks, or one stage of two blocks.
FOUR_BLOCKS = ["--model.n_layers", "4"]


def train_command(
    dump_folder: str, nproc: int, *overrides: str, max_restarts: int = 0, script: str = TRAIN
) -> list[str]:
    """The command line of a train.py run (or ``script``'s) with ``nproc`` ranks (a plain process when 1)."""
    args = [script, *TINY_RUN, "--job.dump_folder", dump_folder, *overrides]
    if nproc > 1:
        args = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            *args,
        ]
    return [sys.executable, *args]


def write_word_corpus(path: str, documents: int, words_per_document: tuple[int, int]) -> str:
    """A .jsonl corpus at ``path`` of made-up sentences, each of a random length in ``words_per_document``."""
    words = "alpha beta gamma delta river mountain cloud engine paper window garden letter number signal".split()
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(documents):
            length = rng.randint(*words_per_document)
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(length)) + "."}) + "\n")
    return str(path)


def train_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched train.py: one thread per rank (the ranks share the cores),
    then ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **(extra or {}))


def launch_train(
    dump_folder: str,
    nproc: int,
    *overrides: str,
    max_restarts: int = 0,
    check: bool = True,
    timeout: float = 600,
    script: str = TRAIN,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Trains with ``nproc`` ranks (a plain process when 1) and torchrun restarting the group up to
    ``max_restarts`` times; returns the finished process. With ``check``, a non-zero exit fails
    with the tail of its output. ``script`` is train.py or TRAIN_AND_REPORT; ``env`` adds to the
    ranks' environment."""
    command = train_command(dump_folder, nproc, *overrides, max_restarts=max_restarts, script=script)
    result = subprocess.run(command, cwd=REPO, env=train_env(env), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed ({result.returncode}):\n{_tail(result)}")
    return result


def run_train(dump_folder: str, nproc: int, *overrides: str, max_restarts: int = 0, timeout: float = 600) -> list[dict]:
    """Trains with ``nproc`` ranks (a plain process when 1) and returns the metrics.jsonl records."""
    launch_train(dump_folder, nproc, *overrides, max_restarts=max_restarts, timeout=timeout)
    return read_metrics(dump_folder)


def script_command(dump_folder: str, *overrides: str) -> list[str]:
    """The command line of a ./run_train.sh run (which adds configs/debug_model.toml, not TINY_RUN)."""
    return ["./run_train.sh", "--job.dump_folder", dump_folder, *overrides]


def script_env(nproc: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """run_train.sh's environment: ``nproc`` ranks per node, this interpreter, then ``env``."""
    return dict(os.environ, NGPU=str(nproc), PYTHON=sys.executable, **(env or {}))


def run_script(
    dump_folder: str,
    *overrides: str,
    env: dict[str, str] | None = None,
    nproc: int = 2,
    check: bool = True,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Runs ./run_train.sh as users do, with ``nproc`` ranks (NGPU) and extra environment ``env``
    (e.g. LOG_RANK, MAX_RESTARTS); returns the finished process. With ``check``, a non-zero exit
    fails with the tail of its output."""
    result = subprocess.run(
        script_command(dump_folder, *overrides),
        cwd=REPO,
        env=script_env(nproc, env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"run_train.sh failed ({result.returncode}):\n{_tail(result)}")
    return result


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each rank in a session of its own, so the
    process group of the agent does not hold the ranks)."""
    tree, i = [pid], 0
    while i < len(tree):
        try:
            tree += [child for task in os.listdir(f"/proc/{tree[i]}/task") for child in _task_children(tree[i], task)]
        except FileNotFoundError:
            pass
        i += 1
    return tree


def _task_children(pid: int, task: str) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{task}/children") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def kill_tree(agent: subprocess.Popen) -> None:
    """SIGKILL to the agent and every rank at once, as a scheduler ends a job; returns when all
    are gone."""
    tree = _process_tree(agent.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in tree):
        assert time.monotonic() < deadline, f"processes {tree} still alive after SIGKILL"
        time.sleep(0.1)


def without_rank_prefixes(output: str) -> str:
    """run_train.sh's output without torchrun's ``[rankN]:`` in front of each rank's lines."""
    return re.sub(r"^\[rank\d+\]:", "", output, flags=re.MULTILINE)


def _tail(result: subprocess.CompletedProcess) -> str:
    return f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def read_metrics(dump_folder: str) -> list[dict]:
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def losses_by_step(records: list[dict]) -> dict[int, float]:
    """Each step's loss; a step logged again after a restart counts with its last value."""
    return {r["step"]: r["loss"] for r in records}


# Gradient norms against one process's: torch's float32 norm on CPU of the 2048 x 256 output-layer
# gradient is itself off by up to ~8e-5 relative in one process (-7.6e-5 against float64 at the
# tiny run's first step); sharded, each rank takes the norm of a smaller piece and errs less.
# Measured: at most 8.8e-5 apart over 10 steps. A gradient scaled by a factor moves it by that factor.
GRAD_NORM_RTOL = 2e-4


def grad_norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in records]


def steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records]


def resumed_from(output: str) -> list[int]:
    """The steps of the checkpoint manager's "resumed from step N" log lines in a run's output, in
    order (not the end-of-run summary's "(resumed from step N)")."""
    return [int(step) for step in re.findall(r"\bINFO resumed from step (\d+)$", output, re.MULTILINE)]


def unloadable_checkpoints(dump_folder: str) -> list[str]:
    """Checkpoint folders moved aside because they failed to load."""
    folder = os.path.join(dump_folder, "checkpoint")
    return sorted(name for name in os.listdir(folder) if name.endswith(".unloadable")) if os.path.isdir(folder) else []


def compile_reports(output: str, run: int = 0) -> list[dict]:
    """TRAIN_AND_REPORT's "REPORT {json}" lines of its ``run``-th run, one per rank, in rank order."""
    reports = [json.loads(line[len("REPORT ") :]) for line in output.splitlines() if line.startswith("REPORT ")]
    return sorted((r for r in reports if r["run"] == run), key=lambda r: r["rank"])


class RunBatch:
    """Named train.py runs (name -> (ranks, overrides)), trained when first asked for: all runs on
    the same number of ranks in one launch of TRAIN_AND_REPORT, one after the other, since a
    launch's start-up (interpreters, imports, the process group) costs more than a tiny run. A
    failed launch fails every run of it, with its output."""

    def __init__(self, root: str, runs: dict[str, tuple[int, list[str]]], timeout: float = 900):
        self.root, self.runs, self.timeout = root, runs, timeout
        self._launched: dict[int, subprocess.CompletedProcess | AssertionError] = {}

    def folder(self, name: str) -> str:
        """The run's dump folder, once it has trained."""
        self._output(self.runs[name][0])
        return os.path.join(self.root, name)

    def records(self, name: str) -> list[dict]:
        return read_metrics(self.folder(name))

    def reports(self, name: str) -> list[dict]:
        """The run's compile reports, one per rank."""
        return compile_reports(self._output(self.runs[name][0]).stdout, run=self._index(name))

    def log(self, name: str) -> str:
        """Rank 0's log of the run (the launch's stderr from the run's first line to the next run's)."""
        nproc = self.runs[name][0]
        sections = re.split(r"INFO batch run \d+ of \d+\n", self._output(nproc).stderr)
        return sections[1 + self._index(name)]

    def _index(self, name: str) -> int:
        nproc = self.runs[name][0]
        return [n for n, (ranks, _) in self.runs.items() if ranks == nproc].index(name)

    def _output(self, nproc: int) -> subprocess.CompletedProcess:
        if nproc not in self._launched:
            batch = []
            for name, (ranks, overrides) in self.runs.items():
                if ranks == nproc:
                    batch += ["---", *TINY_RUN, "--job.dump_folder", os.path.join(self.root, name), *overrides]
            command = train_command(self.root, nproc, script=TRAIN_AND_REPORT)
            command = command[: command.index(TRAIN_AND_REPORT) + 1] + batch[1:]
            try:
                self._launched[nproc] = subprocess.run(
                    command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=self.timeout, check=True
                )
            except subprocess.SubprocessError as e:
                self._launched[nproc] = AssertionError(
                    f"{nproc}-rank batch failed: {e}\n{str(e.stdout)[-2000:]}\n{str(e.stderr)[-4000:]}"
                )
        if isinstance(self._launched[nproc], AssertionError):
            raise self._launched[nproc]
        return self._launched[nproc]


def run_worker(script: str, nproc: int, *args: str, env: dict | None = None, timeout: float = 900) -> str:
    """Runs a torchrun worker script from tests/distributed and returns its stdout; fails with
    the workers' stderr when it exits non-zero."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(REPO, "tests", "distributed", script),
        *args,
    ]
    result = subprocess.run(command, cwd=REPO, env=train_env(env), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(
            f"{script} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}"
        )
    return result.stdout


def limited_memory_cgroup(limit: int) -> str | None:
    """A new memory cgroup (v1 or v2) under this process's, limited to ``limit`` bytes: the path of
    its folder, or None where this process may not make one (not root, no writable controller)."""
    base, limit_file = memory_cgroup()
    folder = os.path.join(base, f"tessera-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(folder)
        with open(os.path.join(folder, limit_file), "w") as f:
            f.write(str(limit))
    except OSError:
        if os.path.isdir(folder):
            os.rmdir(folder)
        return None
    return folder


NO_MEMORY_CGROUP = "needs a memory cgroup of its own (root, a writable cgroup controller)"


@contextlib.contextmanager
def small_disk(folder: str, size: str) -> Iterator[bool]:
    """A file system of ``size`` (tmpfs, e.g. "3m") mounted on ``folder`` while the block runs:
    yields whether it could be mounted (root only)."""
    os.makedirs(folder, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], capture_output=True)
    try:
        yield mounted.returncode == 0
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "--lazy", folder], check=True)


NO_SMALL_DISK = "needs to mount a small tmpfs (root)"


def enter_cgroup(folder: str) -> None:
    """Moves this process into the cgroup at ``folder`` (a ``preexec_fn``: the launched command)."""
    with open(os.path.join(folder, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))

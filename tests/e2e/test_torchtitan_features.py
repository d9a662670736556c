"""torchtitan v0.2.2's Llama 3 integration-test flag lists (tests/torchtitan_lists.py) with its debug
config: every list passes the pre-launch check, or is refused in its one line, in-process (fast); a
representative few train 2 steps through run_train.sh (slow). bench/torchtitan_features.py trains
them all."""

from __future__ import annotations

import os

import pytest

from programs import preflight
from tests.launch import REPO, read_metrics, script_env
from tests.torchtitan_lists import DEBUG_CONFIG, HF_EXPORT, LISTS, TOKENIZER, FlagList

pytestmark = pytest.mark.skipif(
    not os.path.isdir(TOKENIZER), reason=f"torchtitan's test tokenizer is not at {TOKENIZER}"
)

BY_NAME = {flag_list.name: flag_list for flag_list in LISTS}


def checked_runs() -> list:
    """Every run of every list, but a run that loads the files an earlier run writes."""
    return [
        pytest.param(flag_list, run, id=f"{flag_list.name}-{run}")
        for flag_list in LISTS
        for run in range(len(flag_list.runs))
        if HF_EXPORT not in " ".join(flag_list.runs[run])
    ]


def pre_launch(flag_list: FlagList, run: int, dump: str) -> tuple[int, str, str]:
    """run_train.sh's pre-launch check of the run, in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    argv = ["--nnodes", "1", "--nproc-per-node", str(flag_list.ranks), "--job.config_file", DEBUG_CONFIG]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = preflight.main([*argv, *flag_list.argv(run, dump)])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def lighthouse() -> str:
    """torchft's lighthouse, which ft.py's list needs to pass the check (as torchtitan's CI starts one)."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1)
    yield server.address()
    server.shutdown()


@pytest.mark.parametrize("flag_list, run", checked_runs())
def test_each_list_is_accepted_or_refused_in_one_line(flag_list, run, tmp_path, monkeypatch, lighthouse):
    monkeypatch.chdir(REPO)  # the lists' paths (the CSV schedule) are the checkout's
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    code, out, err = pre_launch(flag_list, run, str(tmp_path / "run"))
    if flag_list.expect == "trains":
        assert code == 0, err
        ranks, _, estimate = out.split()
        assert int(ranks) == flag_list.ranks and estimate == str(
            int("--memory_estimation.enable" in flag_list.runs[run])
        )
    else:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1, err
        assert errors[0].startswith("error: " + flag_list.expect.removeprefix("refused: ")), errors[0]


def test_the_table_holds_features_and_ft_lists():
    """44 lists (43 of features.py's Llama 3 lists, ft.py's one), each with its outcome spelt one way."""
    assert len(LISTS) == len(BY_NAME) == 44
    assert {flag_list.expect.split(":")[0] for flag_list in LISTS} <= {"trains", "refused"}


def train(flag_list: FlagList, dump: str) -> list:
    """The list's runs through run_train.sh, one after the other in ``dump``; the finished processes."""
    import subprocess

    env = script_env(flag_list.ranks, {"CONFIG_FILE": DEBUG_CONFIG, "MAX_RESTARTS": "0"})
    return [
        subprocess.run(
            ["./run_train.sh", *flag_list.argv(run, dump)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        for run in range(len(flag_list.runs))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp_custom_csv", "float8_emulation", "fsdp2_memory_estimation", "fsdp+cp"])
def test_representative_lists_train_two_steps_through_run_train(name, tmp_path):
    """A custom CSV schedule, float8 by torchao's emulation, the memory estimate before training, and
    context parallelism within FSDP."""
    dump = str(tmp_path / "run")
    (result,) = train(BY_NAME[name], dump)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]
    # memory_estimation.enable: the dry run's estimate, printed before the ranks start.
    assert ("dry run: rank 0 of 2" in result.stdout) == (name == "fsdp2_memory_estimation"), result.stdout[-2000:]

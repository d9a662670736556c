"""bench/gpu_check.py without a GPU: its options, table and JSON, the runner of its plan, its one-line
answers (no GPU, missing modules), the readers of what its launches print, and the CUDA path as far
as a CPU goes: a probe that sees no GPU on a machine said to have some, the whole check on a faked
GPU machine, and the GPU-sized command lines through Tessera's pre-launch check and dry run. A slow
test rehearses part of the plan on the CPU (scripts/gpu_check.sh --rehearse)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile

import pytest

from bench import gpu_check as gc
from bench import gpu_check_steps as plan
from bench.gpu_check_steps import Context, Row, Step

SCRIPT = os.path.join(gc.REPO, "scripts", "gpu_check.sh")
A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory_gib": 79.1, "capability": "8.0"}


def _machine(**changes) -> dict:
    """What the probe reports on a one-GPU machine without float8 (an A100)."""
    found = {"python": "3.11.7", "torch": "2.11.0+cu130", "cuda": "13.0", "gpus": [A100], "float8": False}
    return found | {"float8_why": "compute capability 8.0", "bf16_peak": "peak 312 TFLOP/s datasheet"} | changes


def _context(tmp_path, sizes=plan.GPU_SIZES) -> Context:
    os.makedirs(tmp_path / "logs", exist_ok=True)
    return Context(str(tmp_path), sys.executable, gc.child_env([], rehearse=True), sizes, _machine())


# Options


def test_defaults_and_the_plan_order_of_chosen_steps():
    args = gc.parse_args([])
    assert args.budget_s == 480 and [s.name for s in args.steps] == [s.name for s in plan.STEPS]
    assert args.out.startswith(gc.OUTPUTS) and not args.rehearse
    rehearsal = gc.parse_args(["--rehearse"])
    assert rehearsal.budget_s == 480 * gc.REHEARSAL_TIME_FACTOR and "rehearsal-" in rehearsal.out
    chosen = gc.parse_args(["--only", "wide_bf16,train_eager", "--budget-s", "90"])
    assert [s.name for s in chosen.steps] == ["train_eager", "wide_bf16"] and chosen.budget_s == 90


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--bogus"], "--bogus"),
        (["--budget-s", "0"], "--budget-s"),
        (["--budget-s", "soon"], "--budget-s"),
        (["--only", "train_eager,warp_drive"], "warp_drive"),
        (["--wheels", "/no/such/folder"], "--wheels"),
        (["--torchtitan-wheel", __file__], "--torchtitan-wheel"),
    ],
)
def test_a_bad_option_is_one_line_naming_it_and_exit_2(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gc.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and err.startswith("gpu_check: error: ")


def test_the_script_refuses_a_bad_option_in_one_line():
    result = subprocess.run([SCRIPT, "--budget-s", "-5"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "gpu_check: error: --budget-s must be more than 0 seconds, got -5\n"


# One-line answers and the CUDA path as far as a CPU goes


@pytest.mark.skipif(gc.nvidia_devices() > 0, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_the_script_prints_one_line_and_exits_0():
    for python in ("python3", sys.executable):  # python3 may lack torch: the answer must not need it
        result = subprocess.run([SCRIPT], env=dict(os.environ, PYTHON=python), capture_output=True, text=True)
        assert (result.returncode, result.stdout, result.stderr) == (0, gc.NO_GPU + "\n", "")


def test_missing_modules_are_one_line_naming_them_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc, "nvidia_devices", lambda: 1)
    monkeypatch.setattr(gc, "probe", lambda python, env: _machine(missing_import="torchdata"))
    monkeypatch.setattr(gc, "module_found", lambda name, paths: name != "tiktoken")
    assert gc.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out == gc.missing_line(["tiktoken", "torchdata"]) + "\n"
    assert gc.missing_line(["torchdata"]).count("\n") == 0 and "--wheels" in gc.missing_line(["x"])


@pytest.mark.slow  # a fresh interpreter imports torch and the project
def test_the_probe_reports_this_cpu_and_a_gpu_torch_cannot_see_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    machine = gc.probe(sys.executable, gc.child_env([], rehearse=True))
    import torch

    assert machine["torch"] == torch.__version__ and machine["gpus"] == [] and "missing_import" not in machine
    monkeypatch.setattr(gc, "nvidia_devices", lambda: 2)
    monkeypatch.setattr(gc, "probe", lambda python, env: machine)
    assert gc.main(["--out", str(tmp_path)]) == 1
    printed = capsys.readouterr()
    assert (
        printed.out == ""
        and printed.err == f"gpu_check: error: torch {torch.__version__} sees none of the 2 NVIDIA devices here\n"
    )


def test_the_check_on_a_faked_gpu_machine_writes_its_rows_and_machine(tmp_path, monkeypatch, capsys):
    """GPU sizes, the real test_cuda step (all skipped here), float8 and torchtitan skipped with reasons."""
    monkeypatch.setattr(gc, "nvidia_devices", lambda: 1)
    monkeypatch.setattr(gc, "probe", lambda python, env: _machine())
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--only", "test_cuda,wide_float8,torchtitan"]) == 0
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["machine"]["gpu_name"] == A100["name"] and results["machine"]["gpu_count"] == 1
    assert {"date", "torch", "cuda", "budget_s"} <= results["machine"].keys()
    rows = {row["step"]: row for row in results["rows"]}
    assert [row["status"] for row in rows.values()] == ["skip"] * 3
    assert "needs CUDA" in rows["test_cuda"]["note"] or "pytest is not installed" in rows["test_cuda"]["note"]
    assert rows["wide_float8"]["note"] == "no float8 matmuls here (compute capability 8.0)"
    assert rows["torchtitan"]["note"] == "no --torchtitan-wheel given"
    printed = capsys.readouterr().out
    assert gc.table([Row(**row) for row in results["rows"]]) in printed
    assert (out / "logs" / "test_cuda.log").exists() or rows["test_cuda"]["note"].startswith("pytest")


def test_the_gpu_sized_command_lines_pass_the_pre_launch_check(tmp_path):
    from config.manager import load_config
    from programs.preflight import check

    ctx = _context(tmp_path)
    dump = str(tmp_path / "run")
    auto = ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable", "--compile.bucketing", "auto"]
    for options in (
        plan.debug_options(ctx, dump, *auto, *plan.AUTO_LINK),
        plan.wide_options(ctx, dump),
        plan.wide_options(ctx, dump, "--model.converters", "float8"),
    ):
        config = load_config(options)
        check(config, 1)
    assert (config.model.n_layers, config.model.vocab_size, config.training.seq_len) == (4, 128256, 8192)
    assert config.activation_checkpoint.mode == "full" and config.compile.enable


@pytest.mark.slow  # a fresh interpreter imports torch and the project
def test_the_gpu_sized_8b_job_fits_an_80_gib_card_by_the_dry_run(tmp_path):
    ctx = _context(tmp_path)
    argv = [sys.executable, "-m", "programs.dry_run", "--world-size", "1", *plan.wide_options(ctx, str(tmp_path))]
    result = subprocess.run(argv, cwd=gc.REPO, env=ctx.env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert 20 < plan.dry_run_estimate(result.stdout) < 0.9 * 80


# Wheels


def _wheel(folder, name: str, module: str) -> str:
    """A pure-Python wheel of ``name`` holding ``module``.py."""
    dist_info = f"{name}-1.0.dist-info"
    path = os.path.join(folder, f"{name}-1.0-py3-none-any.whl")
    files = {
        f"{module}.py": "VALUE = 42\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as wheel:
        for file, text in files.items():
            wheel.writestr(file, text)
        wheel.writestr(f"{dist_info}/RECORD", "".join(f"{file},,\n" for file in [*files, f"{dist_info}/RECORD"]))
    return path


def test_wheels_of_missing_packages_install_without_an_index_and_a_broken_one_is_named(tmp_path):
    wheels, target = tmp_path / "wheels", str(tmp_path / "site")
    wheels.mkdir()
    _wheel(wheels, "gpu_check_sample", "gpu_check_sample_module")
    (wheels / "broken_sample-1.0-py3-none-any.whl").write_text("not a zip")
    installed, failed = gc.install_wheels(sys.executable, str(wheels), target)
    assert installed == ["gpu-check-sample"] and len(failed) == 1 and failed[0].startswith("broken-sample: ")
    assert gc.module_found("gpu_check_sample_module", [target]) and not gc.module_found("gpu_check_sample_module", [])
    (wheels / "broken_sample-1.0-py3-none-any.whl").unlink()
    assert gc.install_wheels(sys.executable, str(wheels), target) == ([], [])  # already there


# The runner, the table and the JSON


def test_every_row_is_written_as_it_comes_and_a_broken_step_fails_without_stopping_the_plan(tmp_path):
    ctx = _context(tmp_path)

    def broken(ctx: Context) -> Row:
        raise KeyError("tps")

    steps = [
        Step("first", 30, lambda ctx: Row("", "pass", tps=1234.5, mfu=float("nan"), note="a | b")),
        Step("second", 30, broken),
        Step("third", 30, lambda ctx: Row("", "skip", note="why")),
    ]
    written = []

    def on_row(rows: list[Row]) -> None:
        path = gc.write_results(str(tmp_path), {"gpu_name": "faked"}, rows)
        written.append(json.loads(open(path).read()))

    rows = gc.run_plan(ctx, steps, 600, on_row)
    assert [len(w["rows"]) for w in written] == [1, 2, 3]
    assert [r.status for r in rows] == ["pass", "fail", "skip"] and gc.exit_status(rows) == 1
    assert rows[1].note == "the check's own error: KeyError: 'tps'"
    assert written[0]["rows"][0]["mfu"] is None and written[-1]["machine"] == {"gpu_name": "faked"}
    assert not os.path.exists(os.path.join(tmp_path, "gpu_check.json.tmp"))
    assert gc.exit_status(rows[::2]) == 0


def test_a_step_may_run_over_while_the_later_ones_keep_half_their_time(tmp_path):
    ctx = _context(tmp_path)
    limits = []

    def measure(ctx: Context) -> Row:
        limits.append(ctx.step_deadline - time.monotonic())
        return Row("", "pass")

    steps = [Step("a", 20, measure), Step("b", 60, measure), Step("c", 40, measure)]
    gc.run_plan(ctx, steps, 100, lambda rows: None)
    # a: twice its 20 s; b: 100 s left less half of c's 40; c: all that is left, capped at twice its own
    assert limits == [pytest.approx(40, abs=1), pytest.approx(80, abs=1), pytest.approx(80, abs=1)]
    assert gc.time_limit(steps, 2, 1000, scale=4) == 2 * 40 * 4  # a rehearsal's seconds
    rows = gc.run_plan(ctx, [Step("a", 1, measure), Step("b", 20, measure)], 15, lambda rows: None)
    # a would keep b from half its 20 s: it does not start, and b gets its time
    assert [r.status for r in rows] == ["skip", "pass"] and rows[0].note == "budget spent (15 s of --budget-s left)"


def test_the_plan_expects_to_fit_the_default_budget():
    assert sum(step.seconds for step in plan.STEPS) <= gc.DEFAULT_BUDGET_S
    assert len({step.name for step in plan.STEPS}) == len(plan.STEPS)


def test_a_launch_out_of_time_is_stopped_with_its_children_and_says_so(tmp_path):
    ctx = _context(tmp_path)
    ctx.step_deadline = time.monotonic() + 1
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    began = time.monotonic()
    launch = plan.run(ctx, "sleeper", [sys.executable, "-c", child])
    assert launch.timed_out and not launch.ok and time.monotonic() - began < 15
    assert launch.failure().startswith("timed out after ")
    assert not _session_alive(launch.process.pid)  # the grandchild too


def _session_alive(pid: int) -> bool:
    for _ in range(50):  # a killed grandchild lingers until init reaps it
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


def test_the_table_has_a_cell_per_column_and_blanks_for_the_unknown():
    rows = [
        Row("wide_bf16", "pass", 61.4, 12345.6, 456.78, 46.2, 41.234, 40.1, "8B | 4 layers"),
        Row("wide_float8", "skip", note="no float8"),
    ]
    lines = gc.table(rows).splitlines()
    assert lines[0].startswith("| step | status | seconds | tokens/s | TFLOP/s | MFU % | peak GiB | estimate GiB |")
    assert {line.count("|") for line in lines} == {10}
    assert lines[2] == "| wide_bf16 | pass | 61 | 12,346 | 457 | 46.2 | 41.23 | 40.10 | 8B / 4 layers |"
    assert lines[3] == "| wide_float8 | skip | 0 |  |  |  |  |  | no float8 |"


# Reading what the launches print


def test_pytest_outcomes():
    skipped = "SKIPPED [6] tests/distributed/test_cuda.py:18: needs CUDA\n6 skipped in 2.5s\n"
    assert plan.pytest_outcome(skipped, 0) == ("skip", "6 skipped in 2.5s (needs CUDA)")
    partly = "SKIPPED [1] tests/distributed/test_cuda.py:98: needs two GPUs\n5 passed, 1 skipped in 41.0s\n"
    assert plan.pytest_outcome(partly, 0) == ("pass", "5 passed, 1 skipped in 41.0s (needs two GPUs)")
    failed = "FAILED tests/distributed/test_cuda.py::test_peak_flops_of_this_gpu[dtype0] - assert 1 == 2\n"
    failed += "==== 1 failed, 5 passed in 3.0s ====\n"
    assert plan.pytest_outcome(failed, 1) == ("fail", "1 failed, 5 passed in 3.0s: test_peak_flops_of_this_gpu[dtype0]")


def test_metrics_figures_loss_gaps_and_the_dry_runs_estimate():
    records = [
        {"step": 1, "loss": 8.0, "tps": 10.0, "tflops": 1.0, "mfu": float("nan"), "memory_gib": 3.0},
        {"step": 2, "loss": 7.0, "tps": 900.0, "tflops": 90.0, "mfu": float("nan"), "memory_gib": 5.0},
        {"step": 3, "loss": 6.0, "tps": 1000.0, "tflops": 100.0, "mfu": float("nan"), "memory_gib": 4.0},
        {"step": 4, "loss": 5.0, "tps": 1200.0, "tflops": 120.0, "mfu": float("nan"), "memory_gib": 4.0},
    ]
    assert plan.figures(records) == {"tps": 1100.0, "tflops": 110.0, "mfu": None, "peak_gib": 5.0}
    assert plan.figures(records[:2])["tps"] == 900.0  # too short to warm up: the last step
    assert plan.loss_gap({1: 8.0, 2: 7.7}, {1: 8.0, 2: 7.0, 3: 6.0}) == pytest.approx(0.1)
    assert plan.loss_gap({5: 1.0}, {1: 1.0}) is None
    assert plan.dry_run_estimate("dry run: ...\n  peak memory per rank 41.25 GiB in step 2 (live tensors") == 41.25
    assert plan.dry_run_estimate("  peak memory per rank 512.0 MiB in step 2") == 0.5
    assert plan.dry_run_estimate("error: model.flavor: unknown") is None


def test_losses_off_the_eager_reference_by_more_than_the_tolerance_fail(tmp_path):
    ctx = _context(tmp_path)
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": loss}) + "\n" for s, loss in [(1, 8.0), (2, 7.0007)])
    )
    assert (
        plan._compare(Row("", "pass", note="run"), ctx, str(dump), 1e-3).note
        == "run; losses not compared (train_eager did not pass)"
    )
    ctx.results["train_eager"] = {1: 8.0, 2: 7.0}
    within = plan._compare(Row("", "pass", note="run"), ctx, str(dump), 1e-3)
    assert (within.status, within.note) == ("pass", "run; max loss gap to train_eager 1.0e-04 (tolerance 1e-03)")
    assert plan._compare(Row("", "pass", note="run"), ctx, str(dump), 1e-5).status == "fail"
    assert plan._compare(Row("", "fail", note="crashed"), ctx, str(dump), 1e-3).note == "crashed"


def test_torchtitans_step_lines():
    line = (
        "[titan] 12:00:0{s} - root - INFO - \x1b[31mstep: {s}  \x1b[32mloss:  {loss}  \x1b[38;2;180;60;0mgrad_norm:  1.2"
        "  \x1b[38;2;54;234;195mmemory: {mem}GiB(40.01%)  \x1b[34mtps: {tps}  \x1b[36mtflops: 400.5  \x1b[35mmfu: 40.50%\x1b[39m"
    )
    text = "\n".join(
        line.format(s=s, loss=9 - s, mem=30 + s, tps=t)
        for s, t in ((1, "90"), (2, "9,000"), (3, "10,000"), (4, "12,000"))
    )
    found = plan.titan_log_figures(text)
    assert found == {"tps": 11000.0, "tflops": 400.5, "mfu": 40.5, "peak_gib": 34.0, "last_step": 4}
    assert plan.titan_log_figures("no steps")["last_step"] is None


@pytest.mark.slow  # trains on the CPU: about a minute
def test_a_rehearsal_of_part_of_the_plan_passes_and_records_it(tmp_path):
    out = tmp_path / "rehearsal"
    steps = "test_cuda,train_eager,fsdp2_eager,async_checkpoint"
    result = subprocess.run(
        [SCRIPT, "--rehearse", "--only", steps, "--out", str(out)],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["step"]: row for row in json.loads((out / "gpu_check.json").read_text())["rows"]}
    assert [row["status"] for row in rows.values()] == ["skip", "pass", "pass", "pass"]
    assert "max loss gap to train_eager 0.0e+00" in rows["fsdp2_eager"]["note"]
    assert "FSDPTransformer with DTensor parameters" in rows["fsdp2_eager"]["note"]
    assert "resumed from step 4, trained steps 5-6" in rows["async_checkpoint"]["note"]
    assert rows["train_eager"]["tps"] > 0 and "| train_eager | pass |" in result.stdout
    assert sorted(os.listdir(out / "logs")) == sorted(f"{name}.log" for name in steps.split(","))

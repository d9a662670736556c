"""scripts/loss_compare.py as users run it: small metrics.jsonl files, the script as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import REPO

SCRIPT = os.path.join(REPO, "scripts", "loss_compare.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(folder, records: list[dict]) -> str:
    """A dump folder whose metrics.jsonl holds ``records``, one JSON line each."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(folder)


def records(steps: int = 5, off: dict[int, float] | None = None) -> list[dict]:
    """Metrics of ``steps`` steps; ``off`` adds a difference to the loss of some steps."""
    off = off or {}
    return [
        {"step": s, "loss": 8.0 - 0.5 * s + off.get(s, 0.0), "grad_norm": 1.0, "lr": 1e-3, "tps": 1000.0 + 10 * s}
        for s in range(1, steps + 1)
    ]


def compare(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG file, after checking its signature."""
    from matplotlib import image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, f"{path} is not a PNG"
    height, width = image.imread(path).shape[:2]
    return width, height


def test_equal_runs_pass_the_check(tmp_path):
    a = write_run(tmp_path / "a", records())
    b = write_run(tmp_path / "b", records())
    result = compare(tmp_path, a, b, "--assert-equal")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "equal: 2 runs agree on loss at all 5 steps" in result.stdout
    assert not (tmp_path / "loss_compare.png").exists()  # a check draws only when --out is given


def test_a_difference_fails_exactly_and_passes_within_tolerance(tmp_path):
    a = write_run(tmp_path / "a", records())
    b = write_run(tmp_path / "b", records(off={3: 1e-3, 4: 1.0}))
    exact = compare(tmp_path, a, b, "--assert-equal")
    assert exact.returncode == 1
    assert exact.stderr.count("\n") == 1 and "step 3:" in exact.stderr, exact.stderr
    assert "mismatch at step 3: loss" in exact.stderr
    # The table shows the difference of each step against the first run.
    assert "+1.000e-03" in exact.stdout

    b = write_run(tmp_path / "b", records(off={3: 1e-3}))
    assert compare(tmp_path, a, b, "--assert-equal", "--rtol", "1e-2").returncode == 0
    assert compare(tmp_path, a, b, "--assert-equal", "--atol", "2e-3").returncode == 0
    assert compare(tmp_path, a, b, "--assert-equal", "--rtol", "1e-6").returncode == 1


def test_other_keys_and_three_runs(tmp_path):
    a = write_run(tmp_path / "a", records())
    b = write_run(tmp_path / "b", records(off={2: 1.0}))  # the loss differs, the grad norm does not
    c = write_run(tmp_path / "c", records())
    assert compare(tmp_path, a, b, c, "--assert-equal", "--key", "grad_norm").returncode == 0
    result = compare(tmp_path, a, c, b, "--assert-equal")
    assert result.returncode == 1 and "step 2:" in result.stderr and " in b " in result.stderr


def test_a_restarted_run_counts_the_last_record_of_each_step(tmp_path):
    reference = records()
    # Trained to step 4, crashed, resumed from the step-2 checkpoint: steps 3 and 4 logged twice.
    first_try = reference[:2] + [dict(r, loss=r["loss"] + 0.25) for r in reference[2:4]]
    restarted = write_run(tmp_path / "restarted", first_try + reference[2:])
    a = write_run(tmp_path / "a", reference)
    result = compare(tmp_path, a, restarted, "--assert-equal")
    assert result.returncode == 0, result.stderr
    assert "at all 5 steps" in result.stdout


def test_a_missing_step_is_a_mismatch(tmp_path):
    a = write_run(tmp_path / "a", records())
    short = write_run(tmp_path / "short", [r for r in records() if r["step"] != 4])
    result = compare(tmp_path, a, short, "--assert-equal")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "step 4:" in result.stderr and "missing in short" in result.stderr
    # Also when the first run is the shorter one.
    assert "step 4:" in compare(tmp_path, short, a, "--assert-equal").stderr


def test_the_picture_is_written(tmp_path):
    a = write_run(tmp_path / "a", records(steps=20))
    b = write_run(tmp_path / "b", records(steps=20, off={5: 0.3}))
    result = compare(tmp_path, a, os.path.join(b, "metrics.jsonl"))
    assert result.returncode == 0, result.stderr
    default = tmp_path / "loss_compare.png"
    assert f"picture: {default}" in result.stdout
    assert default.stat().st_size > 10_000
    width, height = png_size(default)
    assert width >= 600 and height >= 600
    # Every step is in the table, with values of both runs.
    assert all(any(line.split()[:1] == [str(s)] for line in result.stdout.splitlines()) for s in range(1, 21))

    out = tmp_path / "pictures" / "compare.png"
    out.parent.mkdir()
    result = compare(tmp_path, a, b, "--out", str(out), "--assert-equal")
    assert result.returncode == 1 and png_size(out)[0] >= 600  # a failed check still draws with --out


@pytest.mark.parametrize(
    "case, content",
    [
        ("missing folder", None),
        ("folder without metrics.jsonl", ""),
        ("empty", "\n"),
        ("not JSON", '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n'),
        ("no step", '{"loss": 2.0}\n'),
        ("not a number", '{"step": 1, "loss": "high"}\n'),
        ("no loss", '{"step": 1, "tps": 5.0}\n'),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, case, content):
    good = write_run(tmp_path / "good", records())
    bad = tmp_path / "bad"
    if content:
        write_run(bad, [])
        (bad / "metrics.jsonl").write_text(content)
    elif content == "":
        bad.mkdir()
    result = compare(tmp_path, good, str(bad), "--assert-equal")
    assert result.returncode == 2, (case, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0], (case, result.stderr)
    assert "Traceback" not in result.stderr


def test_an_unwritable_picture_is_an_error(tmp_path):
    a = write_run(tmp_path / "a", records())
    b = write_run(tmp_path / "b", records())
    result = compare(tmp_path, a, b, "--out", str(tmp_path / "no" / "such" / "folder.png"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_a_picture_format_matplotlib_does_not_write_is_an_error(tmp_path):
    """``--out compare.jpeg2``: matplotlib's ValueError was a traceback."""
    a = write_run(tmp_path / "a", records())
    b = write_run(tmp_path / "b", records())
    out = tmp_path / "compare.jpeg2"
    result = compare(tmp_path, a, b, "--out", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {out}: cannot write the picture (Format 'jpeg2'"), lines


def test_the_picture_path_printed_is_the_file_written(tmp_path):
    """matplotlib adds .png to an --out without an extension: the path printed is that file (it was
    the name as given, where no file was). An --out that is a folder, or empty, is an error (the
    picture went to ``<folder>.png`` beside it, or to a hidden ``.png``, or silently to the default)."""
    a = write_run(tmp_path / "a", records())
    b = write_run(tmp_path / "b", records())
    result = compare(tmp_path, a, b, "--out", "compare")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"picture: {tmp_path / 'compare.png'}"
    assert png_size(tmp_path / "compare.png")[0] >= 600
    for out in (str(tmp_path / "a"), str(tmp_path / "pictures") + os.sep, ""):
        result = compare(tmp_path, a, b, "--out", out)
        assert (result.returncode, result.stdout) == (2, ""), (out, result.stdout, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}".rstrip()), (out, lines)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "compare.png"]


@pytest.mark.parametrize(
    "args, line",
    [
        ([], "error: the following arguments are required: RUN"),
        (["{a}"], "error: give at least two runs"),
        (["{a}", "{a}", "--rtol", "abc"], "error: argument --rtol: invalid float value: 'abc'"),
        (["{a}", "{a}", "--atol", "-1"], "error: tolerances must be numbers >= 0"),
        (["{a}", "{a}", "--rtol", "nan"], "error: tolerances must be numbers >= 0"),  # no difference is within NaN
        (["{a}", "{a}", "--assert-equals"], "error: unrecognized arguments: --assert-equals"),
    ],
)
def test_a_mistake_in_the_arguments_is_one_error_line(tmp_path, args, line):
    """Without argparse's usage lines before it."""
    a = write_run(tmp_path / "a", records())
    result = compare(tmp_path, *[arg.format(a=a) for arg in args])
    assert (result.returncode, result.stderr.splitlines(), result.stdout) == (2, [line], "")


def test_a_run_given_twice_is_an_error(tmp_path):
    """A run compared with itself passed --assert-equal, having checked nothing; also as its folder
    and its metrics.jsonl, or through a link."""
    a = write_run(tmp_path / "a", records())
    b = write_run(tmp_path / "b", records())
    os.symlink(a, tmp_path / "link")
    a_metrics, link_metrics = os.path.join(a, "metrics.jsonl"), str(tmp_path / "link" / "metrics.jsonl")
    for runs, again, first in (
        ([a, b, a], a_metrics, a_metrics),
        ([a, a_metrics], a_metrics, a_metrics),
        ([str(tmp_path / "link"), a], a_metrics, link_metrics),
    ):
        result = compare(tmp_path, *runs, "--assert-equal")
        assert (result.returncode, result.stdout) == (2, ""), (runs, result.stdout, result.stderr)
        assert result.stderr.splitlines() == [f"error: {again}: the same metrics file as {first}; give each run once"]

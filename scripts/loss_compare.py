"""Compares the metrics of Tessera runs: a per-step table, a picture, and an optional equality check.

    python scripts/loss_compare.py RUN_A RUN_B [RUN_C ...] [--out PNG] [--assert-equal]
                                   [--rtol R] [--atol A] [--key loss]

Each RUN is a run's dump folder (holding ``metrics.jsonl``) or the path of a ``metrics.jsonl``.
A step logged more than once (a run resumed from an earlier checkpoint) counts with its last record.

The table lists every step with each run's value of ``--key`` and its difference to the first run.
The picture (``--out``, default ``loss_compare.png``) has two panels, ``--key`` and tokens/s
(``tps``) against the step, one line per run.

With ``--assert-equal`` the script is a check: it exits 1 with one line on stderr naming the first
step where a run differs from the first one by more than ``atol + rtol * |first|`` (default 0 and 0:
exactly equal), or is missing the step; 0 otherwise. It then writes the picture only if ``--out`` is
given. Unreadable input exits 2 with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import typing
from dataclasses import dataclass

DEFAULT_OUT = "loss_compare.png"
THROUGHPUT_KEY = "tps"
LINE_STYLES = ["-", "--", ":", "-."]


class InputError(Exception):
    """Bad input: reported as one ``error:`` line and exit code 2."""


@dataclass
class Run:
    name: str
    path: str  # the metrics.jsonl file
    records: dict[int, dict]  # step -> its last record

    def value(self, step: int, key: str) -> float | None:
        """The run's ``key`` at ``step``: None when the step or the key is absent, NaN for a null."""
        record = self.records.get(step)
        if record is None or key not in record:
            return None
        value = record[key]
        return math.nan if value is None else float(value)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps (sorted) and values of ``key`` where the run has it."""
        steps = [step for step in sorted(self.records) if self.value(step, key) is not None]
        return steps, [self.value(step, key) for step in steps]


def metrics_file(path: str) -> str:
    """``path`` itself when it is a file, else the metrics.jsonl inside the folder ``path``."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such run folder or metrics file")
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file (is the folder a run's dump folder?)")
    return path


def parse_record(line: str, where: str) -> dict:
    """One metrics.jsonl line: a JSON object with an integer ``step`` and numeric (or null) values."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: not a JSON object")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise InputError(f"{where}: no integer 'step'")
    for key, value in record.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InputError(f"{where}: '{key}' is not a number")
    return record


def read_records(path: str) -> dict[int, dict]:
    """Step -> record of a metrics.jsonl file; a step logged again replaces the earlier record."""
    records: dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    record = parse_record(line, f"{path}:{number}")
                    records[record["step"]] = record
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None
    if not records:
        raise InputError(f"{path}: no metrics records (empty file)")
    return records


def run_names(paths: list[str]) -> list[str]:
    """A legend name per run: its folder's name, or the path as given when two names collide."""
    names = []
    for path in paths:
        folder = os.path.dirname(path) if os.path.isfile(path) else path
        names.append(os.path.basename(os.path.normpath(os.path.abspath(folder))))
    if len(set(names)) < len(names):
        return list(paths)
    return names


def load_runs(paths: list[str], key: str) -> list[Run]:
    runs = []
    for name, path in zip(run_names(paths), paths):
        file = metrics_file(path)
        # A run compared with itself agrees at every step: --assert-equal would pass, checking nothing.
        if same := next((run.path for run in runs if os.path.samefile(run.path, file)), None):
            raise InputError(f"{file}: the same metrics file as {same}; give each run once")
        run = Run(name, file, read_records(file))
        if not run.series(key)[0]:
            raise InputError(f"{file}: no '{key}' values")
        runs.append(run)
    return runs


def all_steps(runs: list[Run]) -> list[int]:
    return sorted(set().union(*(run.records for run in runs)))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.8g}"


def _difference(value: float | None, reference: float | None) -> str:
    if value is None or reference is None:
        return "-"
    return f"{value - reference:+.3e}"


def table(runs: list[Run], key: str) -> str:
    """Per step: each run's value of ``key`` and, after the first run, its difference to the first."""
    header = ["step", f"{runs[0].name} {key}"]
    for run in runs[1:]:
        header += [f"{run.name} {key}", f"{run.name} - {runs[0].name}"]
    rows = [header]
    for step in all_steps(runs):
        reference = runs[0].value(step, key)
        row = [str(step), _number(reference)]
        for run in runs[1:]:
            value = run.value(step, key)
            row += [_number(value), _difference(value, reference)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * width for width in widths), *lines[1:]])


def close_enough(value: float, reference: float, rtol: float, atol: float) -> bool:
    """Within ``atol + rtol * |reference|``; NaN matches only NaN."""
    if math.isnan(value) or math.isnan(reference):
        return math.isnan(value) and math.isnan(reference)
    return value == reference or abs(value - reference) <= atol + rtol * abs(reference)


def first_mismatch(runs: list[Run], key: str, rtol: float, atol: float) -> str | None:
    """The first step (over all runs) where a run is missing or differs from the first run, as a line."""
    reference_run = runs[0]
    for step in all_steps(runs):
        reference = reference_run.value(step, key)
        for run in runs[1:]:
            value = run.value(step, key)
            if reference is None or value is None:
                missing = reference_run if reference is None else run
                return f"mismatch at step {step}: {key} missing in {missing.name} ({missing.path})"
            if not close_enough(value, reference, rtol, atol):
                return (
                    f"mismatch at step {step}: {key} {value!r} in {run.name} vs {reference!r} in "
                    f"{reference_run.name} (difference {value - reference:+.3e}, rtol {rtol:g}, atol {atol:g})"
                )
    return None


def _panel(axes, runs: list[Run], key: str, label: str) -> None:
    plotted = False
    for index, run in enumerate(runs):
        steps, values = run.series(key)
        if steps:
            # Different dashes, so that equal runs (lines on top of each other) all stay visible.
            style = LINE_STYLES[index % len(LINE_STYLES)]
            axes.plot(steps, values, style, marker="." if len(steps) < 50 else None, label=run.name)
            plotted = True
    if not plotted:
        axes.text(0.5, 0.5, f"no '{key}' values", ha="center", va="center", transform=axes.transAxes)
    axes.set_ylabel(label)
    axes.grid(True, alpha=0.3)


def picture_file(out: str) -> str:
    """The file ``--out`` names, with the .png that matplotlib adds to a name without an extension
    (the path printed is then the file written); a folder or nothing is an InputError (matplotlib
    would write ``<folder>.png`` beside a folder, a hidden ``.png`` inside ``<folder>/``)."""
    if not out:
        raise InputError("--out is empty; give the picture's file (e.g. loss_compare.png)")
    if out.endswith(os.sep) or os.path.isdir(out):
        raise InputError(f"--out {out} is a folder; give the picture's file (e.g. {os.path.join(out, DEFAULT_OUT)})")
    return out if os.path.splitext(out)[1] else f"{out}.png"


def plot(runs: list[Run], key: str, out: str) -> None:
    """Writes the two-panel picture (``key`` and tokens/s against the step) to ``out``."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("matplotlib is not installed (scripts/setup_env.sh installs it)") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.ticker import MaxNLocator

    figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(10, 8), sharex=True)
    _panel(top, runs, key, key)
    top.set_title(f"{key} per step")
    top.legend()
    _panel(bottom, runs, THROUGHPUT_KEY, "tokens/s")
    bottom.set_title("throughput (tokens/s per rank)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    try:
        figure.savefig(out, dpi=100)
    except OSError as e:
        raise InputError(f"{out}: cannot write the picture ({e.strerror or e})") from None
    except ValueError as e:  # an extension that is no format matplotlib writes
        raise InputError(f"{out}: cannot write the picture ({e})") from None
    finally:
        pyplot.close(figure)


class OneLineParser(argparse.ArgumentParser):
    """argparse with its mistakes in one ``error:`` line, as the script's others (argparse prints
    its usage first; ``--help`` shows it)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        description="Compare the metrics.jsonl of Tessera runs: table, picture, optional equality check."
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="dump folder of a run, or its metrics.jsonl")
    parser.add_argument("--out", help=f"picture to write (default {DEFAULT_OUT}; with --assert-equal, none)")
    parser.add_argument("--assert-equal", action="store_true", help="exit 1 at the first step that differs")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for --assert-equal (0)")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for --assert-equal (0)")
    parser.add_argument("--key", default="loss", help="the metric to compare (default loss)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two runs")
    if not (args.rtol >= 0 and args.atol >= 0):  # NaN too, which no difference would be within
        parser.error("tolerances must be numbers >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.out is not None:
            out = picture_file(args.out)
        else:
            out = None if args.assert_equal else DEFAULT_OUT
        runs = load_runs(args.runs, args.key)
        print(table(runs, args.key))
        if out:
            plot(runs, args.key, out)
            print(f"picture: {os.path.abspath(out)}")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.assert_equal:
        return 0
    mismatch = first_mismatch(runs, args.key, args.rtol, args.atol)
    if mismatch:
        print(mismatch, file=sys.stderr)
        return 1
    steps = len(all_steps(runs))
    print(f"equal: {len(runs)} runs agree on {args.key} at all {steps} steps (rtol {args.rtol:g}, atol {args.atol:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m programs.calibrate: the alpha-beta fit of each collective, the overlap formula, bad
output paths, and one 2-rank launch writing a calibration file of the documented form."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from models.registry import get_flavor, get_model_spec
from parallelisms.cost_model import COLLECTIVES, FALLBACK_COMM_MODEL, fit_alpha_beta
from programs import calibrate
from programs.plan import MICROBATCHES
from tests.launch import REPO, train_env

# Four ranks: (N - 1) / N = 3/4, so an all-reduce's 2 (N - 1) / N differs from a send's 1.
_RANKS = 4
_ALPHA_S, _BANDWIDTH = 150e-6, 3e9
# Each kind's time as docs/dry-run-and-planner.md states it, for a full buffer (message) of b bytes.
_TIMES = {
    "all_gather": lambda b: _ALPHA_S + (_RANKS - 1) / _RANKS * b / _BANDWIDTH,
    "reduce_scatter": lambda b: _ALPHA_S + (_RANKS - 1) / _RANKS * b / _BANDWIDTH,
    "all_reduce": lambda b: _ALPHA_S + 2 * (_RANKS - 1) / _RANKS * b / _BANDWIDTH,
    "send": lambda b: _ALPHA_S + b / _BANDWIDTH,
}


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_the_fit_recovers_the_latency_and_bus_bandwidth_of_each_kind(kind: str) -> None:
    small, large = 64 * 1024, 16 * 2**20
    model = fit_alpha_beta(kind, _RANKS, (small, _TIMES[kind](small)), (large, _TIMES[kind](large)))
    assert model.alpha_s == pytest.approx(_ALPHA_S, rel=1e-9)
    assert model.bandwidth_bytes_per_s == pytest.approx(_BANDWIDTH, rel=1e-9)


def test_a_large_message_no_slower_than_a_small_one_falls_back() -> None:
    assert fit_alpha_beta("send", 2, (1024, 1e-3), (2**20, 1e-3)) == FALLBACK_COMM_MODEL


@pytest.mark.parametrize(
    ("together_s", "overlap"),
    [
        (10.0, 1.0),  # the 4 s collective wholly behind the 10 s compute
        (12.0, 0.5),  # half of it
        (14.0, 0.0),  # one after the other
        (16.0, 0.0),  # slower than in turn (contention): none, not negative
        (8.0, 1.0),  # faster than the compute alone (noise): all, not more
    ],
)
def test_overlap_is_the_hidden_share_of_the_shorter_one(together_s: float, overlap: float) -> None:
    assert calibrate.overlap_fraction(10.0, 4.0, together_s) == pytest.approx(overlap, abs=1e-12)
    assert calibrate.overlap_fraction(4.0, 10.0, together_s) == pytest.approx(overlap, abs=1e-12)


@pytest.mark.parametrize(
    ("path", "says"),
    [("", "plan.calibration_file: empty"), ("{file}/calibration.json", "plan.calibration_file: ")],
)
def test_a_bad_calibration_file_is_one_line_and_exit_2_before_any_process_group(
    tmp_path, capsys, monkeypatch, path: str, says: str
) -> None:
    def started(*args: object) -> None:
        raise AssertionError("the process group started")

    monkeypatch.setattr(calibrate, "init_distributed", started)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    argv = [
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "64",
        "--plan.calibration_file",
        path.format(file=not_a_folder),
    ]
    assert calibrate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[dict, str]:
    folder = tmp_path_factory.mktemp("calibrate")
    path = folder / "out" / "calibration.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "programs.calibrate", "--model.flavor", "debugmodel", "--training.seq_len", "64"]
    command += ["--training.mixed_precision_param", "float32", "--job.dump_folder", str(folder)]
    command += ["--plan.calibration_file", str(path)]
    run = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(path.read_text()), run.stdout


@pytest.mark.slow  # launches 2 gloo ranks
def test_two_ranks_write_every_figure(launched) -> None:
    data, stdout = launched
    args = get_flavor(get_model_spec("llama3"), "debugmodel")
    assert {k: data[k] for k in ("world_size", "device", "backend", "dtype")} == {
        "world_size": 2,
        "device": "cpu",
        "backend": "gloo",
        "dtype": "float32",
    }
    assert data["model"] == {
        "name": "llama3",
        "flavor": "debugmodel",
        "seq_len": 64,
        "dim": args.dim,
        "n_layers": args.n_layers,
    }
    compute = data["compute"]
    assert compute["microbatches"] == list(MICROBATCHES)
    assert len(compute["block_seconds"]) == len(compute["rest_seconds"]) == len(MICROBATCHES)
    assert all(math.isfinite(s) and s > 0 for s in compute["block_seconds"])
    assert all(math.isfinite(s) and s >= 0 for s in compute["rest_seconds"])  # a difference, clamped at 0
    assert list(data["collectives"]) == list(COLLECTIVES)
    for link in data["collectives"].values():
        assert math.isfinite(link["alpha_us"]) and link["alpha_us"] >= 0  # a fit, clamped at 0
        assert math.isfinite(link["gbps"]) and link["gbps"] > 0
    assert 0 <= data["overlap"] <= 1
    # One line per figure after the heading.
    assert len(stdout.strip().splitlines()) == 1 + 2 + len(COLLECTIVES) + 1, stdout

"""The layout planner (programs/plan.py): known answers at real sizes, its config file, bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from config.job_config import JobConfig
from config.manager import load_config
from models.llama3.pipeline import pipeline_layout
from programs import plan, time_model

GiB = 2**30
REAL = ["--training.seq_len", "8192"]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "programs.plan", *argv], capture_output=True, text=True, timeout=300, check=False
    )


def _plan(tmp_path, flavor: str, devices: int, global_batch: int) -> tuple[float, str, JobConfig]:
    """Plans ``flavor`` on ``devices`` and loads the config it wrote: (the best layout's estimated
    peak in GiB, its table row, the config), checking the layout uses every device."""
    out = tmp_path / "plan.toml"
    argv = ["--model.flavor", flavor, "--plan.devices", str(devices), "--training.global_batch_size"]
    result = _run(*argv, str(global_batch), *REAL, "--plan.top", "1", "--plan.output", str(out))
    assert result.returncode == 0, result.stderr
    best = result.stdout.splitlines()[2]
    config = load_config(["--job.config_file", str(out)])
    p = config.parallelism
    degrees = p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.tensor_parallel_degree
    assert degrees * p.pipeline_parallel_degree == devices
    return float(best.split()[-3]), best, config


@pytest.mark.slow
def test_8b_fits_8_devices_of_80_gib_with_fsdp_and_the_written_config_loads(tmp_path):
    peak, best, config = _plan(tmp_path, "8B", 8, 64)
    assert "fsdp" in best
    assert 0 < peak <= 80
    assert (config.model.flavor, config.training.seq_len, config.training.global_batch_size) == ("8B", 8192, 64)


@pytest.mark.slow
def test_405b_on_8_devices_is_one_line_and_exit_2():
    result = _run("--model.flavor", "405B", "--plan.devices", "8", *REAL)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no layout of 405B fits 8 devices of 80 GiB: the smallest peak is ")
    smallest = float(lines[0].split("the smallest peak is ")[1].split()[0])
    # At least the fp32 master weights, gradients and Adam moments of an eighth of 405B parameters.
    assert smallest > 16 * 405e9 / 8 / GiB


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.flavor", "7B"], "model.flavor"),
        (["--plan.devices", "0"], "error: plan.devices must be >= 1, got 0"),
        (["--plan.mfu", "1.5"], "error: plan.mfu must be in (0, 1], got 1.5"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = _run(*argv)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr


def test_help_lists_every_option():
    """``python -m programs.plan --help`` (it was "error: 'help' must be a [section] table")."""
    result = _run("--help")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("usage: python -m programs.plan ")
    assert "  --plan.devices int (default: 8)" in result.stdout and "  --training.steps int" in result.stdout


def test_it_plans_the_architecture_a_hugging_face_config_gives(tmp_path):
    """``--model.architecture <config.json>`` is planned at that size (it planned the flavor's)."""
    from transformers import LlamaConfig

    hf = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8)
    LlamaConfig(**hf, num_key_value_heads=4, vocab_size=2048).save_pretrained(tmp_path)
    shape = plan.model_shape(load_config(["--model.architecture", str(tmp_path / "config.json")]))
    assert (shape.name, shape.n_layers, shape.dim, shape.vocab) == (str(tmp_path), 3, 512, 2048)
    assert shape.block_params == 2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1024 + 2 * 512  # attention, FFN, norms
    assert shape.other_params == 2 * 2048 * 512 + 512  # embedding, output, final norm


def test_time_model_by_hand():
    """One layout's step time against a hand computation of the README's model."""
    config = load_config(["--model.flavor", "8B", "--plan.devices", "8", "--training.global_batch_size", "8", *REAL])
    shape = plan.model_shape(config)
    assert shape.block_params == 218_112_000 and shape.other_params == 2 * 128256 * 4096 + 4096
    layout = plan.Layout("fsdp2", 1, 8, 1, 1, "", 1, 32, 1, 1, "full")
    tokens = 8 * 8192
    # Full checkpointing recomputes the blocks' forward: a third more of their forward and backward.
    flops = (6 * shape.block_params + 12 * 4096 * 8192) * (1 + 1 / 3) * 32 * tokens + 6 * shape.other_params * tokens
    compute = flops / 8 / (989e12 * 0.4)
    params = 32 * shape.block_params + shape.other_params
    gather = 7 * 33 * 10e-6 + 7 / 8 * params * 2 / 450e9  # 33 collectives (32 blocks and the rest)
    scatter = 7 * 33 * 10e-6 + 7 / 8 * params * 4 / 450e9
    # The root's gather (embedding, final norm and output) opens the forward.
    first = 7 * 10e-6 + 7 / 8 * shape.other_params * 2 / 450e9
    exposed = max(0.0, 2 * gather + scatter - compute) + first
    assert time_model.step_seconds(time_model.Rates(config, shape), layout, 8) == pytest.approx(
        compute + exposed, rel=1e-12
    )


@pytest.mark.slow
def test_its_405b_layout_on_512_devices_fits_by_the_estimator(tmp_path):
    peak, _, _ = _plan(tmp_path, "405B", 512, 1024)
    assert 0 < peak <= 80


def test_the_peak_extrapolates_to_the_largest_stage():
    """Llama 3 405B's 126 blocks on 8 pipeline stages split 15, 16 x 6, 15 (the ends weighted for
    the embeddings and output): the peak is extrapolated to 16 blocks, not 126 // 8 = 15."""
    config = load_config(["--model.flavor", "405B", "--plan.devices", "64", *REAL])
    shape = plan.model_shape(config)
    estimator = plan.PeakEstimator(config, shape)
    layout = next(
        lay
        for lay in plan.enumerate_layouts(config, shape)
        if (lay.impl, lay.shard, lay.tp, lay.pp, lay.schedule, lay.microbatch) == ("fsdp2", 8, 1, 8, "1F1B", 1)
    )
    measured = {1: (100, 0), 2: (130, 0)}  # bytes at 1 and 2 blocks per stage
    estimator._measure = lambda _, blocks: measured[blocks]
    assert estimator.peak_bytes(layout) == 100 + 15 * 30


def test_the_layouts_split_as_planned_whatever_the_config_set(monkeypatch):
    """The planner plans the default split and measures even ones: a config's own
    pipeline_parallel_layers_per_stage is dropped from the written layout and from the dry runs'
    configs (which name their stage boundaries). Each is measured on rank 0 and on the last
    stage's first rank (the logits and the loss)."""
    config = load_config(["--model.flavor", "405B", "--plan.devices", "64", *REAL])
    config.parallelism.pipeline_parallel_layers_per_stage = 3
    shape = plan.model_shape(config)
    layout = next(lay for lay in plan.enumerate_layouts(config, shape) if (lay.pp, lay.schedule) == (8, "1F1B"))
    written = plan.layout_config(config, layout)
    assert pipeline_layout(written, shape.n_layers).num_stages == layout.stages == 8
    measured = []
    monkeypatch.setattr(
        plan, "in_child", lambda _, config, world_size, rank: measured.append((config, world_size, rank)) or (0, 0)
    )
    plan.PeakEstimator(config, shape).peak_bytes(layout)
    one, two = tuple((s,) for s in range(8)), tuple((2 * s, 2 * s + 1) for s in range(8))
    assert [(pipeline_layout(c, c.model.n_layers).stage_layers, world, rank) for c, world, rank in measured] == [
        (one, 64, 0),
        (one, 64, 56),
        (two, 64, 0),
        (two, 64, 56),
    ]


def test_the_search_has_the_microbatches_a_user_tries_and_ddp():
    """Debug model on 2 devices, 16 sequences a step: microbatches 1, 2, 4 and 8 (the debug config's),
    and DDP (replicas without sharding), whose gradient all-reduce is priced in 25 MiB buckets."""
    config = load_config(["--model.flavor", "debugmodel", "--plan.devices", "2", "--training.global_batch_size", "16"])
    shape = plan.model_shape(config)
    layouts = plan.enumerate_layouts(config, shape)
    assert {lay.microbatch for lay in layouts if lay.pp == 1} == {1, 2, 4, 8}
    ddp = next(
        lay
        for lay in layouts
        if (lay.impl, lay.replicate, lay.shard, lay.microbatch, lay.ac) == ("fsdp2", 2, 1, 8, "none")
    )
    assert ddp.describe() == "fsdp2 ddp 2 tp1 mbs 8 ac none"
    # One bucket (the debug model's 6.3M fp32 gradients): a 2-rank ring all-reduce is 2 hops. Compute
    # made free leaves nothing to hide it behind.
    free = dataclasses.replace(config.plan, peak_tflops=1e9)
    slower = dataclasses.replace(config, plan=dataclasses.replace(free, link_latency_us=1010.0))
    fast = dataclasses.replace(config, plan=free)
    seconds = [time_model.step_seconds(time_model.Rates(c, shape), ddp, 16) for c in (slower, fast)]
    assert seconds[0] - seconds[1] == pytest.approx(2e-3)


def test_the_written_config_names_no_other_config_file(tmp_path, caplog):
    """Planned from a config file, the written one loads without "job.config_file ... has no effect"."""
    out = tmp_path / "plan.toml"
    given = ["--job.config_file", "configs/debug_model.toml", "--plan.devices", "2", "--plan.top", "1"]
    result = _run(*given, "--plan.output", str(out))
    assert result.returncode == 0, result.stderr
    load_config(["--job.config_file", str(out)])
    assert "config_file" not in caplog.text


def _calibration(tmp_path, **changes) -> str:
    """A calibration file of made-up round rates: a block takes 10 ms per sequence plus 5 ms, the rest
    4 ms per sequence plus 2 ms; every collective 1 ms per call and 1 GB/s; a third hides."""
    data = {
        "world_size": 2,
        "dtype": "float32",
        "compute": {
            "microbatches": [1, 2, 4, 8],
            "block_seconds": [0.005 + 0.01 * m for m in (1, 2, 4, 8)],
            "rest_seconds": [0.002 + 0.004 * m for m in (1, 2, 4, 8)],
        },
        "collectives": {kind: {"alpha_us": 1000.0, "gbps": 1.0} for kind in time_model.KINDS},
        "overlap": 1 / 3,
    } | changes
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_calibrated_step_by_hand(tmp_path):
    """Debug model on 2 devices from a calibration file: FSDP 2 with 2 passes of 4 sequences, and TP 2
    (each rank computes half a microbatch: the rates extrapolated below 1 sequence)."""
    config = load_config(["--model.flavor", "debugmodel", "--plan.devices", "2", "--training.global_batch_size", "16"])
    shape = plan.model_shape(config)
    rates = time_model.Rates(config, shape, time_model.read_calibration(_calibration(tmp_path)))
    params = 6 * shape.block_params + shape.other_params
    fsdp = plan.Layout("fsdp2", 1, 2, 1, 1, "", 1, 6, 4, 4, "none")
    compute = 2 * (6 * 0.045 + 0.018)  # 2 passes of 6 blocks and the rest at 4 sequences
    gather = 7 * 1e-3 + params * 4 / 2 / 1e9  # 7 units (6 blocks and the root), fp32, half the bytes
    scatter = gather
    dp_comm = 2 * (2 * gather + scatter)
    first = 1e-3 + shape.other_params * 4 / 2 / 1e9
    expected = compute + dp_comm - min(dp_comm / 3, compute) + 2 * first
    assert time_model.step_seconds(rates, fsdp, 16) == pytest.approx(expected, rel=1e-12)
    tp = plan.Layout("fsdp2", 1, 1, 2, 1, "", 1, 6, 8, 16, "none")
    compute = 2 * (6 * 0.045 + 0.018)  # 16 sequences, 2 microbatches of 8, half of each: 4 sequences' rates
    calls = 4 * 6 * 2  # 4 all-gathers and 4 reduce-scatters per block and microbatch
    activation = 8 * 256 * shape.dim * 4
    tp_comm = 2 * (calls * 1e-3 + activation * calls / 2 / 1e9)
    assert time_model.step_seconds(rates, tp, 16) == pytest.approx(compute + tp_comm, rel=1e-12)
    assert rates.block_seconds(0.5) == pytest.approx(0.01)  # 5 ms + 10 ms x 0.5, below the measured
    bent = {"microbatches": [1, 2, 4, 8], "block_seconds": [0.015, 0.025, 0.045, 0.1], "rest_seconds": [0] * 4}
    rates = time_model.Rates(config, shape, time_model.read_calibration(_calibration(tmp_path, compute=bent)))
    assert [rates.block_seconds(m) for m in (3, 6, 16)] == pytest.approx([0.035, 0.0725, 0.21])


@pytest.mark.parametrize(
    "content, message",
    [
        ("{}", "is not a calibration file (no 'compute')"),
        ('{"compute": {}, "collectives": null}', "was measured on one rank"),
    ],
)
def test_a_file_that_is_no_calibration_is_one_line(tmp_path, content, message):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    result = _run("--model.flavor", "debugmodel", "--plan.devices", "2", "--plan.calibration_file", str(path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr and "plan.calibration_file" in result.stderr

"""The dry run (``COMM_MODE=fake``): one process playing rank 0 of a large world on fake tensors.

Each dry run is its own process (the fake process group is the process's default group)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from parallelisms import torch_release
from tests.launch import REPO, TWO_BLOCKS

WORKER = os.path.join(REPO, "bench", "memory_worker.py")

# Print the report's numbers (bytes) as one JSON line, after the dry run of argv on world ranks.
_REPORT = """
import dataclasses, json, sys
from config.manager import load_config
from programs.dry_run import dry_run
report = dry_run(load_config(sys.argv[3:]), int(sys.argv[1]), int(sys.argv[2]))
print("REPORT " + json.dumps(dataclasses.asdict(report)))
"""


def _dry_run(world: int, *argv: str, rank: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT, str(world), str(rank), "--training.seq_len", "64", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


def _debugmodel_shapes(dim: int = 256, n_layers: int = 6, vocab: int = 2048) -> list[tuple[int, ...]]:
    hidden = 768  # debugmodel: int(2 * 4 * 256 / 3) rounded up to a multiple of 256
    per_block = [(dim, dim)] * 4 + [(hidden, dim), (dim, hidden), (hidden, dim)] + [(dim,)] * 2
    return [(vocab, dim)] + per_block * n_layers + [(dim,), (vocab, dim)]


def _adamw_state_bytes(world: int) -> int:
    """Rank 0's AdamW state for the debug model sharded on dim 0 over ``world`` ranks, by hand: two
    fp32 moments of each shard (FSDP2 pads: rank 0 holds ceil(rows / world) rows) and one fp32
    step count per parameter."""
    shapes = _debugmodel_shapes()
    return sum(2 * math.ceil(s[0] / world) * math.prod(s[1:]) * 4 for s in shapes) + 4 * len(shapes)


def test_dry_run_optimizer_state_is_the_hand_counted_shard():
    """FSDP over 8 fake ranks: the optimizer state at the peak is the hand count, to the byte."""
    report = _dry_run(8, "--training.local_batch_size", "8")
    assert report["mesh"] == {"dp_shard": 8}
    assert report["peak"]["Optstate"] == _adamw_state_bytes(8)
    assert report["after_forward"]["Activation"] > 0
    assert report["peak_bytes"] == sum(report["peak"].values())


def test_a_hugging_face_folder_to_fine_tune_is_sized_as_its_config_says(tmp_path):
    """A fine-tuning job's dry run builds the folder's architecture, as the run does (it built the
    flavor's debug model): 3 blocks of width 512, by hand 9,178,624 parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8)
    hf |= dict(num_key_value_heads=4, vocab_size=2048, max_position_embeddings=1024)
    LlamaForCausalLM(LlamaConfig(**hf)).save_pretrained(tmp_path / "hf")
    report = _dry_run(2, "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "hf"))
    blocks = 3 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1024 + 2 * 512)  # wq, wo; wk, wv (4 kv heads); FFN; norms
    assert report["parameters"] == 2 * 2048 * 512 + blocks + 512 == 9_178_624
    assert report["vocab_size"] == 2048


SIMPLE_FSDP_COMPILED = ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable"]


def test_compiled_simple_fsdp_adds_its_two_largest_neighbouring_buckets():
    """Manual buckets (one per block, the embedding, norm + output) of the debug model cut to 2
    blocks, on 8 fake ranks in bf16: the largest neighbouring pair is the two blocks, 852,480
    parameters each at 2 bytes, by hand (the embedding or norm + output with a block: 1.38M)."""
    report = _dry_run(8, *TWO_BLOCKS, *SIMPLE_FSDP_COMPILED, "--compile.bucketing", "manual")
    assert report["buckets"] == 4
    assert report["bucket_pair_bytes"] == 2 * (4 * 256 * 256 + 3 * 768 * 256 + 2 * 256) * 2
    eager = _dry_run(8, *TWO_BLOCKS, "--parallelism.data_parallel_impl", "simple_fsdp")
    assert eager["buckets"] is None and eager["peak_bytes"] == report["peak_bytes"]


def _dry_run_command(*argv: str) -> subprocess.CompletedProcess:
    """``python -m programs.dry_run argv``, finished."""
    command = [sys.executable, "-m", "programs.dry_run", *argv]
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_auto_buckets_without_the_devices_figures_is_one_line():
    proc = _dry_run_command("--world-size", "8", *SIMPLE_FSDP_COMPILED, "--compile.bucketing", "auto")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: compile.bucketing auto in a dry run: set comm.alpha_us, comm.bandwidth_gbps and "
        "compile.compute_flops for the devices it stands for (it cannot time them)"
    ]


def test_a_world_larger_than_a_process_group_holds_is_one_line():
    """NNODES 999,999 x NGPU 9,999, each in its range: the fake process group's size is a C++ int,
    and its constructor ended the dry run in a traceback."""
    proc = _dry_run_command("--world-size", str(999_999 * 9_999))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: world size 9,998,990,001 (NNODES x NGPU) is more than the 2,147,483,647 ranks a torch "
        "process group holds"
    ]


@pytest.mark.slow
def test_bad_layout_at_the_simulated_world_size_is_one_line():
    """A TP degree that does not divide the 8B model's 8 kv heads, at 1,024 simulated ranks."""
    env = dict(os.environ, COMM_MODE="fake", NGPU="1024", PYTHON=sys.executable)
    proc = subprocess.run(
        ["./run_train.sh", "--model.flavor", "8B", "--parallelism.tensor_parallel_degree", "16"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "kv" in lines[0], proc.stderr


@pytest.mark.slow
def test_a_dry_run_is_not_held_to_this_hosts_memory():
    """One block of the 405B model on 2 ranks: 24 GiB of fp32 state per rank, which a real launch
    on a host of less than 48 GiB refuses before any rank starts; the dry run reports its peak,
    with the flavor's vocabulary, and does not claim the default tokenizer's (as it once warned,
    twice, while sizing the flavor's). COMM_MODE spelled as torchtitan's run_train.sh does. The
    config is checked once: a warning is shown once (the script's own check showed it again)."""
    argv = ["--model.flavor", "405B", "--model.n_layers", "1", "--training.seq_len", "128"]
    argv += ["--training.local_batch_size", "1", "--checkpoint.interval", "5"]
    env = dict(os.environ, COMM_MODE="fake_backend", NGPU="2", PYTHON=sys.executable)
    proc = subprocess.run(["./run_train.sh", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak" in proc.stdout, proc.stdout[-3000:]
    assert "(vocabulary 128,256)" in proc.stdout and "from the tokenizer" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("--checkpoint.interval (checkpoint.enable is false)") == 1, proc.stderr[-3000:]


def _real_peak(world: int, argv: list[str], out: str, rank: int = 0) -> dict:
    """``rank``'s peak in a real gloo run of the same config, measured the same way (MemTracker on
    real tensors, bench/memory_worker.py)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(
        [*torchrun, WORKER, out, "--rank", str(rank), *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)["peak"]


FLOAT32 = ["--training.mixed_precision_param", "float32"]


# Emulated: torch._scaled_mm's CPU kernel is correct but takes about 0.9 s for one 256 x 256 product on
# some hosts (AMX); emulation multiplies the same float8-rounded values in float32.
FLOAT8 = ["--model.converters", "float8", "--float8.filter_fqns", "output", "--float8.emulate"]
PP2_1F1B = [
    *("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"),
    *("--parallelism.pipeline_parallel_microbatch_size", "1", "--training.local_batch_size", "2"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,argv,tolerance,rank",
    [
        (1, ["--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full"], 0, 0),
        (2, ["--model.flavor", "debugmodel_wide", "--training.local_batch_size", "2", *FLOAT32], 0, 0),
        # The dry run replays the rank's pipeline actions where the real run runs torch's schedule:
        # measured 2026-11-23, 0.89% under (12.9% under before gradients accumulated unsharded
        # until the closing reduce-scatter, as there).
        (4, ["--training.mixed_precision_param", "bfloat16", *PP2_1F1B], 0.02, 0),
        # The last stage's first rank: the output layer, the logits and the loss.
        (4, ["--training.mixed_precision_param", "bfloat16", *PP2_1F1B], 0.02, 2),
        # Pure bf16 without data parallelism: no autocast, the stages hand on bf16 hidden states
        # (not float32 ones).
        (2, ["--training.dtype", "bfloat16", *PP2_1F1B], 0.02, 1),
        # Parameters stepped in backward: their gradients freed there, their optimizers' state.
        (1, ["--optimizer.early_step_in_backward", *FLOAT32], 0, 0),
        # Float8 linear layers, their weights gathered in float8 (a byte a value) with scales
        # computed after the optimizer step.
        (
            2,
            [
                *FLOAT8,
                "--float8.enable_fsdp_float8_all_gather",
                "--float8.precompute_float8_dynamic_scale_for_fsdp",
                *FLOAT32,
            ],
            0,
            0,
        ),
    ],
    ids=[
        "1rank_bf16_full_ac",
        "wide_fsdp2_2_fp32",
        "pp2_fsdp2_4_bf16",
        "pp2_fsdp2_4_bf16_last_stage",
        "pp2_pure_bf16_last_stage",
        "1rank_fp32_early_step",
        "fsdp2_2_fp32_float8_all_gather",
    ],
)
def test_estimate_matches_a_real_runs_tracked_peak(tmp_path, world, argv, tolerance, rank):
    """The issue asks for 10%; where the dry run runs the same code as the real run the fake
    tensors' storages are the real ones' sizes, so the estimate is exact, every category too.
    bench/estimate_accuracy.py covers 34 cases."""
    argv = ["--training.seq_len", "64", *argv]
    estimate = _dry_run(world, *argv, rank=rank)

    def matches(real: dict) -> bool:
        if tolerance == 0:
            return estimate["peak"] == {k: v for k, v in real.items() if k != "Total"}
        return estimate["peak_bytes"] == pytest.approx(real["Total"], rel=tolerance)

    # On gloo a finished collective's buffers live until gloo's worker thread lets go of its work,
    # which on a loaded host can come after the caller has allocated the next reduce-scatter's
    # (seen on the pipeline case: the previous reduce-scatter's two 2 MiB buffers still alive, 5%
    # over). The worker yields after every wait to let go of them; the program's own peak is the
    # least over runs: up to three.
    reals = []
    while len(reals) < 3 and not (reals and matches(reals[-1])):
        reals.append(_real_peak(world, argv, str(tmp_path / f"real{len(reals)}.json"), rank))
    real = min(reals, key=lambda peak: peak["Total"])
    print(f"estimate {estimate['peak_bytes']} bytes, real {[r['Total'] for r in reals]} bytes")
    if tolerance == 0:
        assert estimate["peak_bytes"] == real["Total"]
        assert estimate["peak"] == {k: v for k, v in real.items() if k != "Total"}
    else:
        assert estimate["peak_bytes"] == pytest.approx(real["Total"], rel=tolerance)


@pytest.mark.slow
def test_8b_on_8_ranks_at_real_size():
    """Llama 3.1 8B (128,256 vocabulary, seq 8192, bf16, full checkpointing) as rank 0 of 8: the
    optimizer state is the hand count (every dimension divides by 8: 2 fp32 moments of an eighth
    of 8,030,261,248 parameters, plus a step count for each of the 291 tensors) and it fits 80 GiB."""
    report = _dry_run(
        8,
        "--model.flavor",
        "8B",
        "--training.seq_len",
        "8192",
        "--training.local_batch_size",
        "1",
        "--training.mixed_precision_param",
        "bfloat16",
        "--activation_checkpoint.mode",
        "full",
    )
    assert report["parameters"] == 8_030_261_248
    assert report["peak"]["Optstate"] == 2 * 4 * 8_030_261_248 // 8 + 4 * 291
    assert report["peak_bytes"] < 80 * 2**30


@pytest.mark.slow
@pytest.mark.skipif(
    not torch_release.runs_v_schedules("cpu"), reason="torch before 2.13 cannot start a V-shaped pipeline over gloo"
)
def test_a_v_schedule_hands_a_ranks_neighbouring_stages_on_in_memory():
    """ZBVZeroBubble on 2 fake ranks puts four stages in a V: rank 1 holds stages 1 and 2 (two
    blocks each), whose hidden state and gradient pass in memory, as torch's stages pass them
    (not sent by the rank to itself). Its real peak cannot be
    compared here: torch's memory tracker does not run under the schedule's split backward."""
    pipeline = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
    report = _dry_run(2, *pipeline, "ZBVZeroBubble", "--training.local_batch_size", "4", rank=1)
    assert report["mesh"] == {"pp": 2}
    block = 4 * 256 * 256 + 3 * 768 * 256 + 2 * 256
    assert report["parameters"] == 4 * block  # stages 1 and 2: no embedding, no output
    assert report["after_forward"]["Activation"] > 0


@pytest.mark.slow
def test_interleaved_pipeline_with_tp_and_fsdp_runs_rank_0s_stages():
    """PP 2 x FSDP 2 x TP 2 with Interleaved1F1B on 8 fake ranks: rank 0 runs stages 0, 2 and 4 of
    six one-block stages (layers 0, 2, 4) and the first holds the embedding, counted by hand."""
    report = _dry_run(
        8,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    )
    assert report["mesh"] == {"pp": 2, "dp_shard": 2, "tp": 2}
    block = 4 * 256 * 256 + 3 * 768 * 256 + 2 * 256
    assert report["parameters"] == 2048 * 256 + 3 * block
    assert report["after_forward"]["Activation"] > 0

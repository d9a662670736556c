"""``training.mixed_precision_param``: ``auto`` decides by the device; one process (and any layout
without data parallelism) runs its forward under autocast, keeping float32 weights and gradients;
float32 leaves the model untouched. tests/distributed/test_mixed_precision.py compares the losses
of the layouts in bfloat16."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config.errors import ConfigError
from config.manager import load_config
from config.rules import validate
from models.builder import _log_precision, build_model, resolve_precision
from models.llama3 import llama3_flavors
from parallelisms.device import causal_query_chunk
from parallelisms.parallel_dims import ParallelDims
from trainer.optim import build_optimizer_and_schedule

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=256, max_seq_len=32, n_layers=2)
BF16 = ["--training.mixed_precision_param", "bfloat16"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_process(*overrides: str) -> tuple[torch.nn.Module, torch.dtype]:
    """The built model and the dtype it says its matmuls run in."""
    config = load_config(list(overrides))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    dims.build_mesh("cpu")
    built = build_model(config, dims, torch.device("cpu"), ARGS)
    return built.parts[0], built.compute_dtype


def forward_backward(model: torch.nn.Module) -> tuple[torch.Tensor, torch.dtype]:
    """(logits, the dtype of the first projection's output)."""
    seen = {}

    def record(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen.setdefault("dtype", output.dtype)

    hook = model.layers["0"].attention.wq.register_forward_hook(record)
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    logits.float().sum().backward()
    hook.remove()
    return logits, seen["dtype"]


def test_one_process_autocasts_and_keeps_float32_weights_and_gradients():
    model, compute_dtype = one_process(*BF16)
    logits, matmul_dtype = forward_backward(model)
    assert compute_dtype == matmul_dtype == logits.dtype == torch.bfloat16
    for name, param in model.named_parameters():
        assert not isinstance(param, DTensor), name  # no data-parallel wrapper on one process
        assert param.dtype == torch.float32, name
        assert param.grad is not None and param.grad.dtype == torch.float32, name


def test_float32_is_left_alone():
    model, compute_dtype = one_process("--training.mixed_precision_param", "float32")
    logits, matmul_dtype = forward_backward(model)
    assert compute_dtype == matmul_dtype == logits.dtype == torch.float32
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_pure_bfloat16_keeps_weights_gradients_and_optimizer_state_in_bfloat16():
    """training.dtype bfloat16 (torchtitan's): the float32 model's initial weights rounded, and
    the forward of that rounded model as plain torch runs it (no autocast); bitwise."""
    model, compute_dtype = one_process("--training.dtype", "bfloat16")
    reference, _ = one_process("--training.mixed_precision_param", "float32")
    reference.to(torch.bfloat16)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert param.dtype == torch.bfloat16 and torch.equal(param, expected), name
    assert model.rope_cache.dtype == torch.float32  # the rotation runs in float32 either way
    reference.rope_cache = model.rope_cache
    attention = model.layers["0"].attention  # narrow heads attend in float32 under bfloat16
    reference.configure_attention(attention.attention_dtype, attention.query_chunk)
    logits, matmul_dtype = forward_backward(model)
    assert compute_dtype == matmul_dtype == torch.bfloat16
    assert torch.equal(logits, forward_backward(reference)[0])
    assert {param.grad.dtype for param in model.parameters()} == {torch.bfloat16}
    config = load_config(["--training.dtype", "bfloat16"])
    optimizer, _ = build_optimizer_and_schedule(config.optimizer, config.lr_scheduler, config.training, [model])
    optimizer.step()
    assert {state["exp_avg"].dtype for state in optimizer.state.values()} == {torch.bfloat16}


def test_pure_bfloat16_does_not_compute_in_float32():
    with pytest.raises(ConfigError, match="training.mixed_precision_param: float32 compute of the bfloat16 weights"):
        validate(load_config(["--training.dtype", "bfloat16", "--training.mixed_precision_param", "float32"]))


def _cpu_has_bf16_instructions() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from /proc/cpuinfo")
def test_auto_is_bfloat16_exactly_where_the_cpu_has_bf16_instructions(caplog):
    with caplog.at_level(logging.INFO, logger="models.builder"):
        decided = resolve_precision(load_config([]), "cpu").training.mixed_precision_param
    assert decided == ("bfloat16" if _cpu_has_bf16_instructions() else "float32")
    assert f"training.mixed_precision_param auto -> {decided}: CPU with" in caplog.text
    for asked in ("float32", "bfloat16"):
        config = load_config(["--training.mixed_precision_param", asked])
        assert resolve_precision(config, "cpu").training.mixed_precision_param == asked


def test_precision_is_one_line(caplog):
    without_dp = ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=1, world_size=2)
    with_dp = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, world_size=4)
    ddp = ParallelDims(dp_replicate=2, dp_shard=1, tp=1, pp=1, world_size=2)  # autocast, as torchtitan's DDP
    float32 = load_config(["--training.mixed_precision_param", "float32"])
    with caplog.at_level(logging.INFO, logger="models.builder"):
        _log_precision(load_config(BF16), without_dp)
        _log_precision(load_config(BF16), with_dp)
        _log_precision(float32, with_dp)  # float32: nothing to say
        _log_precision(float32, without_dp)
        _log_precision(load_config(BF16), ddp)
        _log_precision(load_config([*BF16, "--training.mixed_precision_reduce", "bfloat16"]), ddp)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "mixed precision: forward under bfloat16 autocast, float32 weights and gradients"),
        ("INFO", "mixed precision: bfloat16 parameters in forward and backward, gradients reduced in float32"),
        ("INFO", "mixed precision: forward under bfloat16 autocast, float32 weights and gradients"),
        (
            "INFO",
            "mixed precision: forward under bfloat16 autocast, float32 weights and gradients (reduced in bfloat16)",
        ),
    ]


def test_short_sequences_attend_over_query_chunks_on_a_cpu():
    """Up to 512 tokens torch's CPU kernel computes every key for every query: the model splits
    the queries (parallelisms/device.py causal_query_chunk); longer sequences and GPUs do not."""
    chunks = {seq: causal_query_chunk("cpu", seq) for seq in (128, 256, 512, 1024)}
    assert chunks == {128: None, 256: 128, 512: 128, 1024: None}
    assert causal_query_chunk("cuda", 512) is None
    model, _ = one_process("--training.seq_len", "512")
    assert {layer.attention.query_chunk for layer in model.layers.values()} == {128}
    assert one_process("--training.seq_len", "1024")[0].layers["0"].attention.query_chunk is None


def test_narrow_heads_attend_in_float32_on_a_cpu_under_bfloat16():
    model, _ = one_process(*BF16)  # debugmodel: heads of 16
    attention = model.layers["0"].attention
    assert attention.attention_dtype == torch.float32
    assert one_process("--training.mixed_precision_param", "float32")[0].layers["0"].attention.attention_dtype is None
    wide = dataclasses.replace(ARGS, n_heads=2)  # heads of 128 keep bf16
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    built = build_model(load_config(BF16), dims, torch.device("cpu"), wide)
    assert built.parts[0].layers["0"].attention.attention_dtype is None

    # Under autocast the attention sees bf16 q, k, v and computes in float32: the result equals
    # float32 attention of the bf16-rounded inputs, rounded to bf16.
    q, k, v = (torch.randn(2, 4, 32, 16).to(torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention._attend(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected.to(torch.bfloat16))

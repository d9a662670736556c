"""Float8 training's pieces (parallelisms/float8.py): which layers convert, what is refused where,
and FSDP2's float8 all-gather on gloo ranks (one byte per converted weight value on the wire).
Training through train.py on every layout: tests/distributed/test_float8.py."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from config.errors import ConfigError
from config.manager import load_config
from models.llama3 import llama3_flavors
from models.llama3.model import Transformer
from parallelisms import device
from parallelisms.float8 import apply_float8, check_float8
from parallelisms.fsdp2 import BroadcastAllGather, apply_fsdp2
from programs import preflight
from tests.spawn import check_on_gloo_ranks

# Two blocks; the output's 100 columns are not divisible by 16.
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=100, max_seq_len=16, n_layers=2)
BLOCK_LINEARS = [
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]


def _converted(**options: Any) -> list[str]:
    with torch.device("meta"):
        model = Transformer(ARGS)
    settings = {"recipe_name": "tensorwise", "filter_fqns": [], "emulate": False, "fsdp_float8_all_gather": False}
    return apply_float8(model, **{**settings, **options})


def test_every_linear_layer_of_the_blocks_converts_and_the_filtered_and_uneven_ones_do_not():
    blocks = [f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert _converted() == blocks  # the output (2048 x 100) is left: 100 is not a multiple of 16
    assert _converted(filter_fqns=["feed_forward", "layers.0"]) == [
        f"layers.1.attention.{name}" for name in ("wq", "wk", "wv", "wo")
    ]
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(ARGS, vocab_size=128))
    swapped = apply_float8(model, recipe_name="rowwise", filter_fqns=[], emulate=False, fsdp_float8_all_gather=False)
    assert swapped == [*blocks, "output"] and type(model.output).__name__ == "Float8Linear"


def test_auto_filter_leaves_the_layers_torchao_finds_too_small():
    """torchao's tensorwise thresholds (from H100 timings): a layer converts unless in_features <=
    4096 and out_features <= 1024, so only the 2048-wide w1 and w3 do."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(ARGS, ffn_dim=2048))
    filters = ["auto_filter_small_kn", "layers.1"]
    swapped = apply_float8(
        model, recipe_name="tensorwise", filter_fqns=filters, emulate=False, fsdp_float8_all_gather=False
    )
    assert swapped == ["layers.0.feed_forward.w1", "layers.0.feed_forward.w3"]


def test_without_torchao_float8_is_one_line_before_launch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    monkeypatch.delitem(sys.modules, "torchao.float8", raising=False)
    with pytest.raises(ValueError, match=r"needs the torchao package, not installed here \(pip install torchao\)"):
        check_float8("cpu", emulate=False)
    config = load_config(["--model.converters", "float8", "--training.dataset", "c4_test"])
    with pytest.raises(ConfigError, match="^model.converters: float8 training needs the torchao package"):
        preflight.check(config, world_size=1)


def test_gpus_without_float8_matmuls_need_emulate(monkeypatch):
    assert device.float8_matmuls("cpu") and not device.float8_matmuls("xpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))  # an A100
    assert not device.float8_matmuls("cuda")
    with pytest.raises(ValueError, match="compute capability 8.9 or more.*emulate multiplies"):
        check_float8("cuda", emulate=False)
    check_float8("cuda", emulate=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))  # an H100
    assert device.float8_matmuls("cuda")


_WORLD_SIZE = 2
_TIMEOUT_S = 120


def _gathered_bytes(float8_all_gather: bool, monkeypatch_gather) -> int:
    """Bytes FSDP2 gathers for one forward of a float32 model with float8 blocks."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_float8(
        model, recipe_name="tensorwise", filter_fqns=[], emulate=False, fsdp_float8_all_gather=float8_all_gather
    )
    mesh = dist.device_mesh.init_device_mesh("cpu", (_WORLD_SIZE,))
    blocks = list(model.layers.values())
    apply_fsdp2(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward=True, blocks=blocks
    )
    with torch.no_grad():
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
    sizes = monkeypatch_gather()
    model(torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len)))
    return sum(sizes)


def _check_float8_gathers(rank: int) -> None:
    group = dist.group.WORLD
    # gloo has no float8 types: the broadcast all-gather moves them as bytes.
    shard = (torch.randn(1000) * (rank + 1)).to(torch.float8_e4m3fn)
    output = torch.empty(_WORLD_SIZE * 1000, dtype=torch.float8_e4m3fn)
    BroadcastAllGather()(output, shard, group)
    expected = torch.empty(_WORLD_SIZE * 1000, dtype=torch.uint8)
    dist.all_gather_into_tensor(expected, shard.view(torch.uint8))
    assert torch.equal(output.view(torch.uint8), expected)

    gather = BroadcastAllGather.__call__

    def record():
        sizes = []

        def counting(self, output_tensor, *args, **kwargs):
            sizes.append(output_tensor.nbytes)
            return gather(self, output_tensor, *args, **kwargs)

        BroadcastAllGather.__call__ = counting
        return sizes

    try:
        high, low = _gathered_bytes(False, record), _gathered_bytes(True, record)
    finally:
        BroadcastAllGather.__call__ = gather
    block = Transformer(ARGS).layers["0"]
    linear = sum(module.weight.numel() for module in block.modules() if isinstance(module, torch.nn.Linear))
    norms = sum(p.numel() for p in block.parameters()) - linear
    # The two blocks' weights cross in float8 (a byte a value), their norms in float32; the root's
    # embedding, norm and output in float32 either way.
    assert high - low == 2 * linear * 3
    assert high == 4 * sum(p.numel() for p in Transformer(ARGS).parameters())
    assert norms > 0


@pytest.mark.slow  # spawns gloo ranks
def test_fsdp2_gathers_converted_weights_as_one_byte_a_value() -> None:
    check_on_gloo_ranks(_check_float8_gathers, _WORLD_SIZE, timeout_s=_TIMEOUT_S)

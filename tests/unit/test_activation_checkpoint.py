"""Activation checkpointing changes memory, never the numbers."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from config.manager import load_config
from models.llama3 import Transformer, llama3_flavors
from models.llama3.parallelize import check_llama_layout
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.parallel_dims import ParallelDims

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_heads=4, n_layers=4, vocab_size=128, max_seq_len=32)
MODES = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]


def build(mode: str, option: str) -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    apply_ac(model.layers, mode, option)
    return model


def checkpointed(model: Transformer) -> list[str]:
    """The names of the blocks ``apply_ac`` wrapped."""
    return [name for name, block in model.layers.items() if type(block).__name__ == "CheckpointWrapper"]


def train(model: Transformer, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=generator)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def saved_bytes(model: Transformer) -> int:
    """Bytes autograd keeps for backward after one forward."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).sum()
    return total


def test_losses_are_bitwise_equal_to_no_checkpointing():
    reference = train(build("none", "op"))
    for mode, option in MODES[1:]:
        assert train(build(mode, option)) == reference, (mode, option)


def test_checkpointing_saves_less_for_backward():
    saved = {(mode, option): saved_bytes(build(mode, option)) for mode, option in MODES}
    none = saved["none", "op"]
    assert saved["full", "op"] < saved["selective", "2"] < none
    assert saved["selective", "op"] < none


def test_unwrapped_names_stay_in_the_state_dict():
    assert set(build("full", "op").state_dict()) == set(build("none", "op").state_dict())


@pytest.mark.parametrize("option", ["op", "1", "3"])
def test_every_nth_layer_is_wrapped(option):
    model = build("selective", option)
    wrapped = checkpointed(model)
    if option == "op":
        assert len(wrapped) == ARGS.n_layers
    else:
        n = int(option)
        assert wrapped == [str(i) for i in range(ARGS.n_layers) if (i + 1) % n == 0]


def test_every_nth_block_of_a_pipeline_stage_counts_the_models_blocks():
    """A stage holding blocks 3 to 5 checkpoints 3 and 5 for every 2nd, as the whole model does; it
    counted its own blocks (4), and for every 3rd block with 2 blocks a stage checkpointed none."""
    model = Transformer(dataclasses.replace(ARGS, n_layers=6))
    for name in ("0", "1", "2"):
        del model.layers[name]
    apply_ac(model.layers, "selective", "2")
    assert checkpointed(model) == ["3", "5"]


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_ends_a_blocks_recomputation_once_backward_has_what_it_needs(early_stop):
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    apply_ac(model.layers, "full", early_stop=early_stop)
    calls = []
    for block in model.layers.values():
        # The last projection's output is saved by nothing: early stop never runs it again.
        block._checkpoint_wrapped_module.feed_forward.w2.register_forward_hook(lambda *args: calls.append(1))
    logits = model(torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)))
    forward_calls = len(calls)
    logits.sum().backward()
    recomputed = 0 if early_stop else len(model.layers)
    assert (forward_calls, len(calls) - forward_calls) == (len(model.layers), recomputed)


class Dropout(torch.nn.Module):
    """A block that draws random numbers."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.weight, p=0.5).exp()


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_preserve_rng_state_makes_the_recomputation_draw_the_same_numbers(preserve_rng_state):
    def gradient(checkpointed: bool) -> torch.Tensor:
        blocks = torch.nn.ModuleDict({"0": Dropout()})
        if checkpointed:
            apply_ac(blocks, "full", preserve_rng_state=preserve_rng_state)
        torch.manual_seed(0)
        blocks["0"](torch.ones(64, 8)).sum().backward()
        return blocks["0"].weight.grad

    assert torch.equal(gradient(True), gradient(False)) == preserve_rng_state


class ShapeShifter(torch.nn.Module):
    """A block whose recomputation saves a tensor of another shape than its forward did."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.weight * torch.full((4 if self.calls == 1 else 1,), 2.0)


@pytest.mark.parametrize(
    "determinism_check, debug, error",
    [("default", False, "different metadata"), ("default", True, "dumping logs"), ("none", False, None)],
)
def test_determinism_check_and_debug_reach_the_checkpoint(determinism_check, debug, error):
    blocks = torch.nn.ModuleDict({"0": ShapeShifter()})
    apply_ac(blocks, "full", determinism_check=determinism_check, debug=debug)
    output = blocks["0"](torch.randn(2, 4, requires_grad=True)).sum()
    if error is None:
        output.backward()
    else:
        with pytest.raises(torch.utils.checkpoint.CheckpointError, match=error):
            output.backward()


def test_every_nth_block_past_the_last_is_a_warning_before_launch(caplog):
    """selective_ac_option 5 of 4 blocks checkpoints none of them: said by the pre-launch check."""
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    for option, warned in (("4", False), ("5", True)):
        config = load_config(
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", option]
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger="models.llama3.parallelize"):
            check_llama_layout(ARGS, dims, config)
        assert bool(caplog.records) == warned, option
    assert caplog.messages == [
        "activation_checkpoint.selective_ac_option 5 is more than the model's 4 blocks: no block is checkpointed"
    ]
    assert not checkpointed(build("selective", "5"))


def test_selective_without_an_option_checkpoints_every_second_block_as_torchtitan():
    """torchtitan's selective_ac_option defaults to 2: mode selective alone checkpoints blocks 2
    and 4 of 4 (torchtitan counts them from 1), not the op-level policy on every block."""
    ac = load_config(["--activation_checkpoint.mode", "selective"]).activation_checkpoint
    model = Transformer(ARGS)
    apply_ac(model.layers, ac.mode, ac.selective_ac_option)
    wrapped = checkpointed(model)
    assert wrapped == ["1", "3"]

"""Activation checkpointing changes memory, never the numbers."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models.llama3 import Transformer, llama3_flavors
from parallelisms.activation_checkpoint import apply_ac

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_heads=4, n_layers=4, vocab_size=128, max_seq_len=32)
MODES = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]


def build(mode: str, option: str) -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    apply_ac(model.layers, mode, option)
    return model


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
    wrapped = [name for name, block in model.layers.items() if type(block).__name__ == "CheckpointWrapper"]
    if option == "op":
        assert len(wrapped) == ARGS.n_layers
    else:
        n = int(option)
        assert wrapped == [str(i) for i in range(ARGS.n_layers) if (i + 1) % n == 0]

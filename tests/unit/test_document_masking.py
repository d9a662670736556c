"""Document masking on one process: a packed window of documents trains as the documents alone,
the mask's kernels agree, no gradient leaves an ignored label, and without positions the model and
the loss take the causal path."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from config.job_config import Compile, Training, Validation
from models.builder import BuiltModel, document_masking
from models.llama3 import Transformer, TransformerModelArgs, llama3_flavors
from models.llama3.model import Attention, apply_rotary_emb, attend, causal_attention, document_mask
from parallelisms.device import document_kernel
from parallelisms.parallel_dims import ParallelDims
from trainer.data.batch import IGNORE_INDEX, Batch
from trainer.loss import Loss, summed_cross_entropy, trained_labels
from trainer.validate import Validator

ARGS = TransformerModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=48)
DOC_LENGTHS = (17, 12, 19)  # one window of 48 tokens: three documents
ONE_RANK = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)


def model(args: TransformerModelArgs = ARGS) -> Transformer:
    built = Transformer(args)
    built.init_weights(seed=0)
    return built


def documents(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ARGS.vocab_size, (n,), generator=generator) for n in DOC_LENGTHS]


def packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loader's window of ``docs``: inputs, labels (the next document's first token ignored)
    and positions restarting per document; the last label is the window's next token, a fresh one."""
    tokens = torch.cat([*docs, torch.tensor([5])])
    inputs, labels = tokens[:-1].clone(), tokens[1:].clone()
    starts = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0)[:-1].tolist()])
    labels[starts[1:] - 1] = IGNORE_INDEX
    positions = torch.cat([torch.arange(len(d)) for d in docs])
    return inputs[None], labels[None], positions[None]


def packed_and_alone_losses(net: Transformer) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed window's loss through the trainer's Loss, and the token-weighted mean of each
    document's loss run alone (its own next-token labels; the last document's label past its end is
    the window's next token, as in the window)."""
    docs = documents()
    inputs, labels, positions = packed(docs)
    loss = Loss(inputs.numel(), ONE_RANK, Compile(), enable_loss_parallel=False, ignores_labels=True)
    loss.start_step([labels], torch.device("cpu"))
    packed_loss = loss(net(inputs, positions), labels)
    summed, count = 0.0, 0
    for i, doc in enumerate(docs):
        last = i == len(docs) - 1
        doc_inputs = doc[None]
        doc_labels = torch.cat([doc[1:], torch.tensor([5])]) if last else doc[1:]
        logits = net(doc_inputs)[:, : len(doc_labels)]
        summed = summed + F.cross_entropy(logits.flatten(0, 1), doc_labels, reduction="sum")
        count += len(doc_labels)
    return packed_loss, summed / count


def test_a_packed_window_has_the_token_weighted_mean_loss_of_its_documents_alone():
    net = model()
    packed_loss, alone = packed_and_alone_losses(net)
    torch.testing.assert_close(packed_loss, alone, rtol=1e-5, atol=1e-5)
    # And so do their gradients: the packed step trains as the documents alone.
    packed_grads = torch.autograd.grad(packed_loss, list(net.parameters()))
    alone_grads = torch.autograd.grad(alone, list(net.parameters()))
    for got, expected in zip(packed_grads, alone_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_without_positions_the_documents_see_each_other():
    """The property above holds because of the mask: the same window run causally differs."""
    net = model()
    docs = documents()
    inputs, labels, positions = packed(docs)
    assert not torch.allclose(net(inputs), net(inputs, positions), atol=1e-3)


def test_no_gradient_crosses_a_document_boundary_or_leaves_an_ignored_label():
    """The last document's loss does not depend on the earlier documents' inputs, and the logits at
    ignored labels get exactly zero gradient."""
    net = model()
    inputs, labels, positions = packed(documents())
    hidden = net.tok_embeddings(inputs).detach().requires_grad_()
    net.tok_embeddings = None  # the form of a later pipeline stage: hidden states in
    logits = net(hidden, positions)
    start = sum(DOC_LENGTHS[:-1])
    last_doc_loss = F.cross_entropy(logits[0, start:], labels[0, start:], reduction="sum")
    (grad,) = torch.autograd.grad(last_doc_loss, hidden)
    assert grad[0, :start].abs().max() == 0
    assert grad[0, start:].abs().max() > 0

    logits = logits.detach().requires_grad_()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    ignored = labels[0] == IGNORE_INDEX
    assert ignored.sum() == len(DOC_LENGTHS) - 1
    assert logits.grad[0, ignored].abs().max() == 0
    assert logits.grad[0, ~ignored].abs().min() > 0


def test_a_window_starting_inside_a_document_equals_that_part_alone():
    """Positions need not start at 0: RoPE is relative, so a document's tail at positions k, k+1, ...
    attends as it would at 0, 1, ... (float32 rounding)."""
    net = model()
    tail = documents()[0][5:]
    positions = torch.arange(5, 5 + len(tail))[None]
    torch.testing.assert_close(net(tail[None], positions), net(tail[None]), rtol=1e-5, atol=1e-5)


def test_rope_rotates_each_document_as_if_it_stood_alone():
    """Under the mask the loss cannot tell RoPE's offsets (attention scores depend on relative
    positions only), so this is checked where they act: the first block's rotated queries of each
    packed document equal, bitwise, those of the document run alone."""
    net = model()
    docs = documents()
    inputs, _, positions = packed(docs)
    attention = net.layers["0"].attention
    seen = []
    hook = attention.register_forward_pre_hook(lambda module, args: seen.append(args), with_kwargs=False)

    def rotated_queries(tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        seen.clear()
        net(tokens, positions)
        x, rope = seen[0]
        q = attention.wq(x).view(*x.shape[:2], -1, attention.head_dim)
        return apply_rotary_emb(q, rope)

    with torch.no_grad():
        window = rotated_queries(inputs, positions)
        start = 0
        for doc in docs:
            alone = rotated_queries(doc[None], None)
            assert torch.equal(window[:, start : start + len(doc)], alone)
            start += len(doc)
    hook.remove()


@pytest.mark.parametrize("chunk", [8, 16])
def test_query_chunks_under_the_document_mask_equal_the_whole(chunk: int):
    net = model()
    inputs, _, positions = packed(documents())
    whole = net(inputs, positions)
    net.configure_attention(None, chunk)
    torch.testing.assert_close(net(inputs, positions), whole, rtol=1e-6, atol=1e-6)


def test_the_block_mask_of_flex_attention_gives_the_boolean_masks_result():
    """CUDA's kernel (flex attention with a BlockMask) against the CPU's masked SDPA, forward only:
    torch 2.13 has no CPU backward for flex attention."""
    _, _, positions = packed(documents())
    positions = torch.cat([positions, torch.roll(positions, 7, dims=1)])  # a second row starting mid-document
    q, k, v = (torch.randn(2, 4, positions.shape[1], 16) for _ in range(3))
    boolean = attend(q, k, v, None, document_mask(positions, "sdpa"))
    with torch.no_grad():
        flex = flex_attention(q, k, v, block_mask=document_mask(positions, "flex"))
    torch.testing.assert_close(flex, boolean, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles flex attention (~15 s on 2 cores)
def test_the_model_under_the_cuda_kernel_gives_the_cpu_kernels_logits():
    net = model()
    inputs, _, positions = packed(documents())
    expected = net(inputs, positions)
    net.configure_attention(None, None, "flex")
    with torch.no_grad():
        torch.testing.assert_close(net(inputs, positions), expected, rtol=1e-5, atol=1e-5)


def test_the_device_picks_the_kernel():
    assert document_kernel("cuda") == "flex"
    assert document_kernel("cpu") == "sdpa"


def test_without_a_mask_attention_is_the_causal_kernel_bitwise():
    """``mask=None`` runs causal_attention as it is, whole and in query chunks, forward and backward."""
    attention = Attention(ARGS)
    x = torch.randn(2, 40, ARGS.dim)
    rope = Transformer(ARGS).rope_cache
    for chunk in (None, 16):
        attention.query_chunk = chunk
        q, k, v = (torch.randn(2, 8, 40, 8, requires_grad=True) for _ in range(3))
        ours, theirs = attend(q, k, v, chunk, None), causal_attention(q, k, v, chunk)
        assert torch.equal(ours, theirs)
        assert all(
            torch.equal(a, b)
            for a, b in zip(torch.autograd.grad(ours.sum(), (q, k, v)), torch.autograd.grad(theirs.sum(), (q, k, v)))
        )
        assert torch.equal(attention(x, rope), attention(x, rope, mask=None))


def test_positions_counting_from_zero_in_one_document_are_the_causal_model():
    """One document per window: the masked path gives the causal path's logits (other kernels, so
    to rounding); positions None takes the causal path itself."""
    net = model()
    inputs = documents()[0][None]
    positions = torch.arange(inputs.shape[1])[None]
    torch.testing.assert_close(net(inputs, positions), net(inputs), rtol=1e-5, atol=1e-5)
    assert torch.equal(net(inputs, None), net(inputs))


def test_pipeline_stages_with_positions_compose_to_the_full_model():
    net = model(dataclasses.replace(ARGS, n_layers=4))
    first, last = copy.deepcopy(net), copy.deepcopy(net)
    for name in ("2", "3"):
        del first.layers[name]
    first.norm = first.output = None
    for name in ("0", "1"):
        del last.layers[name]
    last.tok_embeddings = None
    inputs, _, positions = packed(documents())
    with torch.no_grad():
        torch.testing.assert_close(last(first(inputs, positions), positions), net(inputs, positions), rtol=0, atol=0)


def test_compiled_blocks_with_positions_equal_eager():
    torch._dynamo.reset()
    net = model()
    inputs, labels, positions = packed(documents())
    expected = net(inputs, positions)
    for block in net.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(net(inputs, positions), expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# The loss's divisor and the masking decision
# ---------------------------------------------------------------------------


def test_the_loss_divides_by_the_trained_labels_only_where_labels_can_be_ignored():
    labels = [torch.tensor([[1, IGNORE_INDEX, 3, 4]]), torch.tensor([[IGNORE_INDEX, 2, 2, 2]])]
    assert [trained_labels(t) for t in labels] == [3, 3]
    ignoring = Loss(8, ONE_RANK, Compile(), enable_loss_parallel=False, ignores_labels=True)
    ignoring.start_step(labels, torch.device("cpu"))
    assert ignoring.divisor == 6
    ignoring.start_step([torch.full((1, 4), IGNORE_INDEX)], torch.device("cpu"))
    assert ignoring.divisor == 1  # no trained label: loss 0, not NaN
    plain = Loss(8, ONE_RANK, Compile(), enable_loss_parallel=False)
    plain.start_step(labels, torch.device("cpu"))
    assert plain.divisor == 8

    logits = torch.randn(1, 4, 5)
    tokens = torch.randint(0, 5, (1, 4))
    # Without ignored labels: the summed loss over the step's token count, as the division is written.
    assert torch.equal(plain(logits, tokens), plain.summed(logits, tokens) / 8)


@pytest.mark.parametrize(
    "setting, dataset_format, flavor, expected",
    [
        ("auto", "text", "debugmodel", False),
        ("auto", "chat", "debugmodel", True),
        ("auto", "text", "debugmodel_flex_attn", True),
        ("on", "text", "debugmodel", True),
        ("off", "chat", "debugmodel", False),
        ("off", "text", "debugmodel_varlen_attn", False),
    ],
)
def test_the_trainer_decides_masking(setting, dataset_format, flavor, expected, caplog):
    training = Training(document_masking=setting, dataset_format=dataset_format)
    with caplog.at_level("INFO"):
        assert document_masking(training, llama3_flavors[flavor]) == expected
    said_off = "training.document_masking off: the flavor's block-causal attention is off" in caplog.text
    assert said_off == (setting == "off" and flavor.endswith("_attn"))


@pytest.mark.parametrize(
    "masked, base",
    [
        ("debugmodel_flex_attn", "debugmodel"),
        ("debugmodel_varlen_attn", "debugmodel"),
        ("8B_flex", "8B"),
        ("8B_varlen", "8B"),
    ],
)
def test_torchtitans_block_causal_flavors_are_their_base_with_document_masking(masked, base):
    assert llama3_flavors[masked] == dataclasses.replace(llama3_flavors[base], attn_mask_type="block_causal")


@pytest.mark.parametrize("ignores_labels", [True, False])
def test_validation_averages_over_the_trained_labels(ignores_labels: bool):
    """With labels that can be ignored, the mean over the trained ones; otherwise over every label,
    as the division by the token count is written."""
    net = model()
    batches = [Batch(*packed(documents(seed))) for seed in (1, 2)]
    if not ignores_labels:
        batches = [Batch(b.inputs, b.inputs.roll(-1, dims=1)) for b in batches]
    loss = Loss(1, ONE_RANK, Compile(), enable_loss_parallel=False, ignores_labels=ignores_labels)
    validator = Validator(Validation(enable=False, steps=2), lambda: iter(batches), dp_degree=1, loss=loss)
    built = BuiltModel([net], ARGS, 1.0, torch.float32, autocast=False)
    with torch.no_grad():
        summed = sum(summed_cross_entropy(net(b.inputs, positions=b.positions), b.labels) for b in batches)
        expected = summed / sum(trained_labels(b.labels) if ignores_labels else b.labels.numel() for b in batches)
        got = validator.validate(built, torch.device("cpu"), step=1)
    assert torch.equal(got, expected) if not ignores_labels else torch.allclose(got, expected, rtol=1e-6)

"""Unit tests of the Llama 3 model: sizes, RoPE, attention, init and pipeline splitting."""

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from models.llama3 import Transformer, TransformerModelArgs, flops_per_token, llama3_flavors, num_params
from models.llama3.model import (
    Attention,
    apply_rotary_emb,
    causal_attention,
    ffn_hidden_dim,
    precompute_rope_cache,
    rope_inv_freq,
)


def tiny_args(**overrides) -> TransformerModelArgs:
    """A model small enough to run many forwards in milliseconds."""
    args = TransformerModelArgs(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=32
    )
    return dataclasses.replace(args, **overrides)


def truncated_normal_std(std: float, cutoff_stds: float) -> float:
    """Actual std of a zero-mean normal(std) truncated at +-cutoff_stds * std."""
    density_at_cutoff = math.exp(-(cutoff_stds**2) / 2) / math.sqrt(2 * math.pi)
    mass_inside = math.erf(cutoff_stds / math.sqrt(2))
    return std * math.sqrt(1 - 2 * cutoff_stds * density_at_cutoff / mass_inside)


# ---------------------------------------------------------------------------
# Sizes and FLOPs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flavor", "expected_params", "expected_ffn_hidden"),
    [
        ("1B", 1.24e9, 8192),
        ("3B", 3.21e9, 8192),
        ("8B", 8.03e9, 14336),
        ("70B", 70.55e9, 28672),
        ("405B", 405.85e9, 53248),
    ],
)
def test_published_parameter_counts(flavor: str, expected_params: float, expected_ffn_hidden: int):
    args = llama3_flavors[flavor]
    assert args.vocab_size == 128256
    with torch.device("meta"):
        model = Transformer(args)
    total = num_params(model, exclude_embedding=False)
    assert abs(total - expected_params) / expected_params < 0.005
    assert ffn_hidden_dim(args) == expected_ffn_hidden
    # A tied table (Llama 3.2) is counted once, and its matmul as the output head costs FLOPs.
    embedding_only = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    assert total - num_params(model, exclude_embedding=True) == embedding_only


def test_flops_per_token_counts_weights_and_attention():
    args = llama3_flavors["8B"]
    flops = flops_per_token(args, num_params_non_embedding=7_000_000_000, seq_len=8192)
    assert flops == 6 * 7e9 + 12 * 32 * 32 * 128 * 8192


# ---------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------


def test_rope_scaling_matches_hand_computation():
    args = TransformerModelArgs(dim=128, n_heads=1, rope_theta=500000.0, use_rope_scaling=True)
    head_dim = 128
    context, low, high, factor = 8192, 1.0, 4.0, 8.0
    scaled = rope_inv_freq(args)

    seen_bands = set()
    for i in range(head_dim // 2):
        freq = 1.0 / 500000.0 ** (2 * i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            band, expected = "high", freq
        elif wavelength > context / low:
            band, expected = "low", freq / factor
        else:
            band = "middle"
            smooth = (context / wavelength - low) / (high - low)
            expected = (1 - smooth) * freq / factor + smooth * freq
        seen_bands.add(band)
        assert scaled[i].item() == pytest.approx(expected, rel=1e-5), (i, band)
    assert seen_bands == {"high", "middle", "low"}

    unscaled = rope_inv_freq(dataclasses.replace(args, use_rope_scaling=False))
    assert unscaled[-1].item() == pytest.approx(8 * scaled[-1].item(), rel=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rotary_emb_keeps_input_dtype_under_mixed_precision(cache_dtype: torch.dtype):
    args = tiny_args()
    cache = precompute_rope_cache(args)
    x = torch.randn(2, 16, 4, args.head_dim)
    reference = apply_rotary_emb(x, cache)
    rotated = apply_rotary_emb(x.bfloat16(), cache.to(cache_dtype))
    assert rotated.dtype == torch.bfloat16
    torch.testing.assert_close(rotated.float(), reference, atol=0.05, rtol=0.02)
    # A rotation preserves the norm of every pair.
    torch.testing.assert_close(reference.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_emb_equals_the_rotation_written_out_bitwise(head_dim: int):
    """Each (even, odd) pair (a, b) at angle t becomes (a cos t - b sin t, a sin t + b cos t), the
    formula of Meta's and Hugging Face's real-valued code; the complex multiply gives the same bits
    at the head widths of the debug model (16) and of Llama 3 (64, 128). (At width 8 torch's CPU
    complex multiply differs from it in the last bit of some elements.)"""
    args = dataclasses.replace(tiny_args(), dim=4 * head_dim, n_heads=4)
    cache = precompute_rope_cache(args)
    x = torch.randn(2, 16, 4, head_dim)
    cos, sin = cache[:16, None, :].chunk(2, dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    expected = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    assert torch.equal(apply_rotary_emb(x, cache), expected)


def test_rotary_emb_under_compile_equals_the_complex_multiply_bitwise():
    """Under torch.compile the rotation is spelt out in real operations (Inductor generates no code
    for complex ones, and a nested compile region's backward cannot hold them): compiled, it gives
    the eager complex multiply's bits, forward and backward, at the debug model's head width."""
    torch._dynamo.reset()
    args = dataclasses.replace(tiny_args(), dim=64, n_heads=4)
    cache = precompute_rope_cache(args)
    x, grad = torch.randn(2, 16, 4, 16), torch.randn(2, 16, 4, 16)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    results = []
    for rotate in (apply_rotary_emb, torch.compile(apply_rotary_emb, backend="aot_eager", fullgraph=True)):
        leaf = x.clone().requires_grad_()
        out = rotate(leaf, cache)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames + 1  # it did compile
    (eager_out, eager_grad), (compiled_out, compiled_grad) = results
    assert torch.equal(compiled_out, eager_out)
    assert torch.equal(compiled_grad, eager_grad)


@pytest.mark.parametrize("seq, chunk", [(512, 128), (300, 128), (96, 32)])
def test_causal_attention_over_query_chunks_equals_the_whole(seq: int, chunk: int):
    """Each chunk of queries attends to the keys up to its own last row under a mask: outputs and
    the gradients of q, k and v equal the causal kernel's on all queries at once, to float32
    rounding (1e-6; with one key too many in each row of a chunk some elements are off by more
    than 1)."""
    q, k, v, grad = (torch.randn(2, 3, seq, 16, dtype=torch.float64).float() for _ in range(4))
    results = []
    for query_chunk in (None, chunk):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = causal_attention(*inputs, query_chunk)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in inputs)])
    for whole, chunked in zip(*results):
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def test_logits_shape():
    args = tiny_args()
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (3, 10))
    assert model(tokens).shape == (3, 10, args.vocab_size)


def test_causality_is_exact():
    torch.manual_seed(0)
    args = tiny_args()
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % args.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def reference_attention(attn: Attention, x: torch.Tensor, args: TransformerModelArgs) -> torch.Tensor:
    """Meta-style GQA: complex-number RoPE, one explicit softmax per query head."""
    bs, seqlen, _ = x.shape
    n_kv_heads, head_dim = args.n_kv_heads, args.head_dim
    q = (x @ attn.wq.weight.T).view(bs, seqlen, args.n_heads, head_dim)
    k = (x @ attn.wk.weight.T).view(bs, seqlen, n_kv_heads, head_dim)
    v = (x @ attn.wv.weight.T).view(bs, seqlen, n_kv_heads, head_dim)

    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seqlen).float(), inv_freq)
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * rotation).flatten(-2)

    q, k = rotate(q), rotate(k)
    future = torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool), diagonal=1)
    heads = []
    for h in range(args.n_heads):
        kv = h // (args.n_heads // n_kv_heads)
        scores = q[:, :, h] @ k[:, :, kv].transpose(-1, -2) / math.sqrt(head_dim)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        heads.append(weights @ v[:, :, kv])
    return torch.cat(heads, dim=-1) @ attn.wo.weight.T


def test_gqa_attention_matches_reference():
    torch.manual_seed(0)
    args = tiny_args()
    attn = Attention(args)
    x = torch.randn(2, 12, args.dim)
    cache = precompute_rope_cache(args)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cache), reference_attention(attn, x, args), atol=1e-5, rtol=1e-5)


def test_attention_with_head_sharded_weights_sums_to_full():
    """Tensor parallelism: each rank keeps a slice of the heads; wo partial sums add up."""
    torch.manual_seed(0)
    args = tiny_args()
    full = Attention(args)
    x = torch.randn(2, 12, args.dim)
    cache = precompute_rope_cache(args)
    tp_degree = 2
    partial_sum = torch.zeros_like(x)
    with torch.no_grad():
        for rank in range(tp_degree):
            shard = copy.deepcopy(full)
            for name in ("wq", "wk", "wv"):
                weight = getattr(full, name).weight.chunk(tp_degree, dim=0)[rank]
                getattr(shard, name).weight = nn.Parameter(weight.clone())
            shard.wo.weight = nn.Parameter(full.wo.weight.chunk(tp_degree, dim=1)[rank].clone())
            partial_sum += shard(x, cache)
        torch.testing.assert_close(partial_sum, full(x, cache), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# State dict and initialisation
# ---------------------------------------------------------------------------


def test_state_dict_keys_are_stable_fqns():
    model = Transformer(tiny_args(n_layers=2))
    per_layer = [
        "attention_norm.weight",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "ffn_norm.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    ]
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert set(model.state_dict()) == expected
    assert "rope_cache" in dict(model.named_buffers())


def meta_init(args: TransformerModelArgs, seed: int) -> Transformer:
    """Build on meta, materialise uninitialised memory, then init_weights."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.rope_cache.fill_(float("nan"))  # make the to_empty garbage visible
    model.init_weights(buffer_device=torch.device("cpu"), seed=seed)
    return model


@pytest.mark.parametrize("depth_init", [True, False])
def test_meta_init_gives_intended_weights(depth_init: bool):
    args = dataclasses.replace(llama3_flavors["debugmodel"], depth_init=depth_init)
    model = meta_init(args, seed=0)

    for name, tensor in model.state_dict().items():
        assert torch.isfinite(tensor).all(), name
    torch.testing.assert_close(model.rope_cache, precompute_rope_cache(args), rtol=0, atol=0)

    def assert_std(weight: torch.Tensor, expected: float) -> None:
        assert weight.std().item() == pytest.approx(expected, rel=0.05)

    assert_std(model.tok_embeddings.weight, 1.0)
    assert_std(model.output.weight, truncated_normal_std(args.dim**-0.5, 3.0))
    assert torch.equal(model.norm.weight, torch.ones(args.dim))
    for layer_id, layer in model.layers.items():
        depth = int(layer_id) + 1 if depth_init else args.n_layers
        out_proj_std = truncated_normal_std(0.02 / math.sqrt(2 * depth), 2.0)
        assert torch.equal(layer.attention_norm.weight, torch.ones(args.dim))
        assert torch.equal(layer.ffn_norm.weight, torch.ones(args.dim))
        for weight in (layer.attention.wq.weight, layer.attention.wk.weight, layer.feed_forward.w1.weight):
            assert_std(weight, truncated_normal_std(0.02, 2.0))
            assert weight.abs().max() <= 0.04
        assert_std(layer.attention.wo.weight, out_proj_std)
        assert_std(layer.feed_forward.w2.weight, out_proj_std)

    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.isfinite(model(tokens)).all()


def test_init_is_deterministic_given_seed():
    args = tiny_args()
    first, second, other = meta_init(args, seed=1), meta_init(args, seed=1), meta_init(args, seed=2)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    assert not torch.equal(first.output.weight, other.output.weight)


def test_every_64_bit_seed_initializes():
    """debug.seed takes any 64-bit integer: the weights' generator seeds wrap modulo 2**64 (a seed
    past about 1e13 overflowed the generator in every rank, a traceback restarted by torchrun).
    Seeds that fitted keep their weights: torch takes a negative seed modulo 2**64 itself."""
    args = tiny_args()
    largest, smallest = meta_init(args, seed=2**63 - 1), meta_init(args, seed=-(2**63))
    assert not torch.equal(largest.output.weight, smallest.output.weight)


# ---------------------------------------------------------------------------
# Pipeline splitting
# ---------------------------------------------------------------------------


def test_pipeline_stages_compose_to_full_model():
    torch.manual_seed(0)
    args = tiny_args(n_layers=4)
    full = Transformer(args)
    full.init_weights()

    first_stage, last_stage = copy.deepcopy(full), copy.deepcopy(full)
    for layer_id in ("2", "3"):
        del first_stage.layers[layer_id]
    first_stage.norm = None
    first_stage.output = None
    for layer_id in ("0", "1"):
        del last_stage.layers[layer_id]
    last_stage.tok_embeddings = None

    assert "layers.3.attention.wq.weight" in last_stage.state_dict()
    assert not any(key.startswith("tok_embeddings") for key in last_stage.state_dict())

    tokens = torch.randint(0, args.vocab_size, (2, 10))
    with torch.no_grad():
        hidden = first_stage(tokens)
        assert hidden.shape == (2, 10, args.dim)
        torch.testing.assert_close(last_stage(hidden), full(tokens), rtol=0, atol=0)

"""Llama 3 / 3.1 decoder-only transformer, written to be sharded and pipelined.

Attention infers its local head counts from the projected tensors (tensor parallelism needs no
change here); ``layers`` is keyed by the global layer index so a pipeline stage keeps the full
model's parameter names; built on the meta device, ``init_weights`` fills it after ``to_empty``.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from parallelisms.device import DocumentKernel
from parallelisms.names import clean_name

from .context_parallel import ContextParallel, ContextParallelMask, context_parallel_inputs
from .kv_cache import KVCache, LayerKVCache

INIT_STD = 0.02


@dataclass
class TransformerModelArgs:
    """Hyper-parameters of a Llama 3 transformer."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (``None``: same as ``n_heads``)."""
    vocab_size: int = 128256
    """The trainer overrides it with the tokenizer's."""
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None
    """SwiGLU hidden width (HF's ``intermediate_size``); ``None``: see ``ffn_hidden_dim``."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_rope_scaling: bool = False
    """Llama 3.1 long-context scaling of the RoPE frequencies (see ``rope_inv_freq``)."""
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    max_seq_len: int = 2048
    """Longest sequence the rotary table covers; the trainer sets it to the training length."""
    max_position_embeddings: int | None = None
    """Context length of the published model, written to an export's config; ``None``: max_seq_len."""
    tie_word_embeddings: bool = False
    depth_init: bool = True
    """Scale the init std of wo/w2 by each layer's depth instead of by the total layer count."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """block_causal: packed documents attend only within themselves (``forward``'s ``positions``)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_inv_freq(args: TransformerModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Radians per position of each feature pair of a head, shape [head_dim // 2]. Llama 3.1 scaling
    keeps the bands shorter than original_max_position_embeddings / high_freq_factor, divides those
    longer than that / low_freq_factor by rope_scaling_factor, and interpolates linearly between."""
    head_dim = args.head_dim
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if not args.use_rope_scaling:
        return inv_freq

    wavelength = 2 * math.pi / inv_freq
    context_over_wavelength = args.rope_original_max_position_embeddings / wavelength
    # 0 for low-frequency bands (fully scaled), 1 for high-frequency bands (kept).
    keep_weight = (context_over_wavelength - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    keep_weight = keep_weight.clamp(0.0, 1.0)
    return (1 - keep_weight) * inv_freq / args.rope_scaling_factor + keep_weight * inv_freq


def precompute_rope_cache(args: TransformerModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Float32 table [max_seq_len, head_dim] of cos then sin angles: real-valued so it moves,
    casts and shards like any tensor."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, rope_inv_freq(args, device))
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rope_angles(rope_cache: torch.Tensor, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin in float32, shaped to broadcast over [batch, seqlen, heads, head_dim // 2]: from
    the table's first ``seqlen`` rows, or from a per-token table [batch, seqlen, head_dim] (rows
    gathered at each token's position)."""
    if rope_cache.dim() == 3:
        cos, sin = rope_cache.float().chunk(2, dim=-1)
        return cos[:, :, None, :], sin[:, :, None, :]
    cos, sin = rope_cache[:seqlen].float().chunk(2, dim=-1)
    return cos[None, :, None, :], sin[None, :, None, :]


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotates each interleaved (even, odd) feature pair of ``x`` [batch, seqlen, heads, head_dim]
    (Meta's pairing) by its position's angle, in float32 whatever the dtypes (bf16 under mixed
    precision), cast back to ``x.dtype``. ``rope_cache``: the table (positions 0, 1, ...) or one
    row per token (see ``_rope_angles``)."""
    cos, sin = _rope_angles(rope_cache, x.shape[1])
    if torch.compiler.is_compiling():
        # Inductor generates no code for complex operators (and a nested compile region's backward
        # cannot hold them): spelt out in real operations, it fuses the rotation. The same bits.
        pairs = x.float().unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)
    # One complex multiply: on a CPU 7x faster, forward and backward, than real multiplies and a stack.
    rotation = torch.complex(cos, sin)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    # Set where the device asks for them (see Transformer.configure_attention).
    attention_dtype: torch.dtype | None = None
    query_chunk: int | None = None

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        mask: DocumentMask | None = None,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """``mask`` (``document_mask``): attention within each packed document; None: causal.
        ``cache``: generation's, which attends to the positions before this forward's tokens too."""
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism only this rank's heads are present.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q = apply_rotary_emb(q, rope_cache)
        k = apply_rotary_emb(k, rope_cache)
        if cache is not None:
            return self.wo(cache.attend(q, k, v).reshape(bs, seqlen, -1))

        # Query head h reads kv head h // n_rep; sharding keeps this ratio per rank.
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)

        out = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        if self.attention_dtype is None or self.attention_dtype == v.dtype:
            return attend(q, k, v, self.query_chunk, mask)
        dtype = self.attention_dtype
        # Autocast would cast the inputs back to its own dtype.
        with torch.autocast(v.device.type, enabled=False):
            out = attend(q.to(dtype), k.to(dtype), v.to(dtype), self.query_chunk, mask)
        return out.to(v.dtype)


# What keeps packed documents apart: a boolean [batch, 1, seq, seq] mask (True: may attend) for SDPA,
# or flex attention's BlockMask (see ``document_mask``); under context parallelism, what crosses the
# ranks (causal or within documents).
DocumentMask = torch.Tensor | BlockMask | ContextParallelMask


def document_mask(positions: torch.Tensor, kernel: DocumentKernel) -> DocumentMask:
    """Block-causal attention of packed documents, for ``kernel``: a query sees the keys of its own
    document up to itself. A document starts where ``positions`` [batch, seq] is 0 (a window's
    first tokens may continue one begun before it)."""
    documents = (positions == 0).cumsum(dim=1)
    if kernel == "sdpa":
        seqlen = positions.shape[1]
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=positions.device).tril()
        return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seqlen = positions.shape
    return create_block_mask(same_document_causal, batch, None, seqlen, seqlen, device=positions.device)


@functools.cache
def _compiled_flex_attention() -> Callable:
    """Eager flex attention runs an unfused reference that holds every score; compiled, it is the
    fused kernel that skips the blocks the mask empties. Made on first use: torch.compile imports
    the compiler, seconds of every rank's start that runs without document masks need not pay."""
    return torch.compile(flex_attention)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_chunk: int | None, mask: DocumentMask | None
) -> torch.Tensor:
    """Attention over [batch, heads, seq, head_dim]: causal without ``mask``, else within documents."""
    if mask is None:
        return causal_attention(q, k, v, query_chunk)
    if isinstance(mask, ContextParallelMask):
        return mask.attend(q, k, v)
    if isinstance(mask, BlockMask):
        # A compiled model traces flex attention into its own graph.
        flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
        return flex(q, k, v, block_mask=mask)
    seqlen = q.shape[-2]
    if query_chunk is None or seqlen <= query_chunk:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # As causal_attention: rows start .. stop see no key past stop.
    outputs = []
    for start in range(0, seqlen, query_chunk):
        stop = min(start + query_chunk, seqlen)
        rows, keys, values = q[..., start:stop, :], k[..., :stop, :], v[..., :stop, :]
        outputs.append(F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask[..., start:stop, :stop]))
    return torch.cat(outputs, dim=-2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_chunk: int | None) -> torch.Tensor:
    """Causal SDPA over [batch, heads, seq, head_dim], the queries in chunks of ``query_chunk`` rows
    each attending to the keys up to its last row: the same result, for kernels that mask the keys
    past a query rather than skip them (``parallelisms.device.causal_query_chunk``)."""
    seqlen = q.shape[-2]
    if query_chunk is None or seqlen <= query_chunk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    outputs = []
    for start in range(0, seqlen, query_chunk):
        stop = min(start + query_chunk, seqlen)
        # Row r of the chunk is position start + r: it sees keys 0 .. start + r.
        mask = torch.ones(stop - start, stop, dtype=torch.bool, device=q.device).tril(start)
        keys, values = k[..., :stop, :], v[..., :stop, :]
        outputs.append(F.scaled_dot_product_attention(q[..., start:stop, :], keys, values, attn_mask=mask))
    return torch.cat(outputs, dim=-2)


def ffn_hidden_dim(args: TransformerModelArgs) -> int:
    """``ffn_dim``, else 2/3 of 4 * dim (the FLOPs of a 4x GELU MLP), scaled, rounded up."""
    if args.ffn_dim is not None:
        return args.ffn_dim
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * math.ceil(hidden / args.multiple_of)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        hidden_dim = ffn_hidden_dim(args)
        self.w1 = nn.Linear(args.dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        mask: DocumentMask | None = None,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            h = x + self.attention(self.attention_norm(x), rope_cache, cache=cache)
        elif mask is None:
            h = x + self.attention(self.attention_norm(x), rope_cache)
        else:
            # A keyword: tensor parallel's plan and compile regions take attention's two positional inputs.
            h = x + self.attention(self.attention_norm(x), rope_cache, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


def check_args(args: TransformerModelArgs) -> None:
    """ValueError unless the heads split the width into heads of even width and the FFN has a width."""
    n_kv_heads = args.n_kv_heads or args.n_heads
    if args.dim % args.n_heads or args.n_heads % n_kv_heads or args.head_dim % 2:
        raise ValueError(
            f"need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head_dim, "
            f"got dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={n_kv_heads}"
        )
    if ffn_hidden_dim(args) < 1:
        raise ValueError(
            f"ffn_dim_multiplier {args.ffn_dim_multiplier} leaves the feed-forward no width at dim {args.dim}"
        )


class Transformer(nn.Module):
    """Llama 3 decoder. A pipeline stage sets ``tok_embeddings``, ``norm`` or ``output`` to None and
    deletes blocks; ``forward`` passes its input through the missing parts (hidden states in/out)."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        check_args(args)
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Non-persistent: derived from args, so it stays out of checkpoints.
        self.register_buffer("rope_cache", precompute_rope_cache(args), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            # One parameter under two names: state dicts list both, named_parameters() one.
            self.output.weight = self.tok_embeddings.weight

    # The kernel that keeps packed documents apart (``parallelisms.device.document_kernel``).
    document_kernel: DocumentKernel = "sdpa"
    # Set by ``apply_cp``: the sequence is split over these ranks, ``forward`` gets this rank's tokens.
    context_parallel: ContextParallel | None = None
    # Set by ``apply_tp``: a pipeline stage's hidden-state input holds 1/tp of its sequence (sequence parallel).
    hidden_sequence_shards: int = 1

    def configure_attention(
        self, dtype: torch.dtype | None, query_chunk: int | None, document_kernel: DocumentKernel = "sdpa"
    ) -> None:
        """Attention in ``dtype`` (None: its inputs'), queries in chunks of ``query_chunk`` rows,
        packed documents kept apart by ``document_kernel``."""
        self.document_kernel = document_kernel
        for layer in self.layers.values():
            layer.attention.attention_dtype = dtype
            layer.attention.query_chunk = query_chunk

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Logits of ``tokens`` [batch, seq] (hidden states in and out on a pipeline stage without
        the embedding or output). With ``positions`` [batch, seq], each token's position in its
        document (0 where one starts), RoPE takes those positions and attention stays inside each
        document; without, positions are 0, 1, ... and attention is causal over the whole sequence.
        Under context parallelism ``tokens`` and ``positions`` hold this rank's chunks of the sequence.
        With a ``cache`` (generation), ``positions`` are the tokens' places in their sequences: their
        keys and values are cached there and each attends to every cached position up to its own."""
        cp = self.context_parallel
        seq_local = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.hidden_sequence_shards)
        seqlen = seq_local * (cp.degree if cp is not None else 1)
        if seqlen > self.rope_cache.shape[0]:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len {self.rope_cache.shape[0]}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if cache is not None:
            cache.start(positions)
            rope_rows = self.rope_cache[positions]
            for name, layer in self.layers.items():
                h = layer(h, rope_rows, cache=cache.layer(name))
        elif cp is not None:
            # This rank's chunks of the sequence (``context_parallel_inputs``), causal or within documents.
            rope_rows, mask = context_parallel_inputs(cp, seq_local, self.rope_cache, positions)
            for layer in self.layers.values():
                h = layer(h, rope_rows, mask)
        elif positions is None:
            for layer in self.layers.values():
                h = layer(h, self.rope_cache)
        else:
            # Built once for all blocks: the rotary rows at each token's position, and the mask.
            rope_rows = self.rope_cache[positions]
            mask = document_mask(positions, self.document_kernel)
            for layer in self.layers.values():
                h = layer(h, rope_rows, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self, buffer_device: torch.device | None = None, seed: int = 0) -> None:
        """(Re)initialises every parameter (see ``_init_fn``) and the rotary table (garbage after
        ``to_empty``), in place. Each parameter draws from a generator seeded by ``seed`` and its
        name, so the weights do not depend on the parallel layout, pipeline split or init order."""
        self.rope_cache = precompute_rope_cache(self.args, buffer_device or self.rope_cache.device)
        if self.args.tie_word_embeddings:
            # to_empty gives each module a tensor of its own. The registered parameters, not the
            # attributes: under SimpleFSDP those are the gathered weights.
            table = self.tok_embeddings._parameters["weight"]
            if self.output._parameters["weight"] is not table:
                self.output.register_parameter("weight", table)
        for name, param in self.named_parameters():
            name = clean_name(name)  # the model's own name, whatever wrappers were applied
            _init_param_(param, _init_fn(name, self.args), seed=seed, name=name)


def _init_fn(name: str, args: TransformerModelArgs) -> Callable[[torch.Tensor, torch.Generator], None]:
    """The initialiser of the parameter called ``name`` (a full-model FQN). wo/w2 write into the
    residual stream: shrinking them with depth keeps its variance from growing with the layers. A
    tied table is initialised as the output, whose scale the logits need."""

    def trunc_normal(std: float, cutoff_stds: float):
        return lambda t, g: nn.init.trunc_normal_(t, 0.0, std, -cutoff_stds * std, cutoff_stds * std, generator=g)

    if name == "tok_embeddings.weight" and not args.tie_word_embeddings:
        return lambda t, g: nn.init.normal_(t, 0.0, 1.0, generator=g)
    if name in ("output.weight", "tok_embeddings.weight"):
        return trunc_normal(args.dim**-0.5, 3.0)
    if name.endswith("norm.weight"):
        return lambda t, g: nn.init.ones_(t)
    if name.endswith((".wo.weight", ".w2.weight")):
        depth = int(name.split(".")[1]) + 1 if args.depth_init else args.n_layers
        return trunc_normal(INIT_STD / math.sqrt(2 * depth), 2.0)
    if name.endswith((".wq.weight", ".wk.weight", ".wv.weight", ".w1.weight", ".w3.weight")):
        return trunc_normal(INIT_STD, 2.0)
    raise ValueError(f"no initialiser for parameter {name}")


def _init_param_(
    param: torch.Tensor, init: Callable[[torch.Tensor, torch.Generator], None], *, seed: int, name: str
) -> None:
    """Fills ``param`` with ``init`` drawn in float32 from a generator keyed by (seed, name). A
    DTensor is drawn whole on every rank, which keeps its shard: the values of an unsharded model."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if is_fake(local):  # a dry run's tensors hold no values (and rejection sampling would need them)
        return
    # Modulo 2**64: the generator's range.
    generator = torch.Generator(device=local.device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64)
    if not isinstance(param, DTensor) and param.dtype == torch.float32:
        init(param, generator)
        return
    full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
    init(full, generator)
    if isinstance(param, DTensor):
        # Every rank holds the same full tensor, so no broadcast is needed: each slices its shard.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(full)


def num_params(model: nn.Module, exclude_embedding: bool) -> int:
    """Global parameters of ``model``, a tied table once. ``exclude_embedding`` drops the embedding
    table, whose lookup costs no FLOPs (unless tied: then it is also the output head's matmul)."""
    total = sum(p.numel() for p in model.parameters())
    embeddings = getattr(model, "tok_embeddings", None)
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    if exclude_embedding and embeddings is not None and not tied:
        total -= embeddings.weight.numel()
    return total


def flops_per_token(args: TransformerModelArgs, num_params_non_embedding: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight (2 forward, 4 backward) plus the attention matmuls,
    without the causal half-saving (PaLM's MFU convention)."""
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6.0 * num_params_non_embedding + attention

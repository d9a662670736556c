"""Llama 3 model and its named sizes ("flavors").

The flavor instances are shared: copy one (``dataclasses.replace``) before changing
fields such as ``vocab_size`` or ``max_seq_len``.
"""

import dataclasses

from .model import Transformer, TransformerModelArgs, flops_per_token, num_params

__all__ = ["Transformer", "TransformerModelArgs", "flops_per_token", "llama3_flavors", "num_params"]

# What every published Llama 3.1 and 3.2 size shares.
_LLAMA31 = dict(
    n_kv_heads=8,
    vocab_size=128256,
    norm_eps=1e-5,
    rope_theta=500000,
    use_rope_scaling=True,
    max_position_embeddings=131072,
)
# Llama 3.2 1B and 3B: tied embeddings, a 8192-wide FFN and RoPE scaling by 32.
_LLAMA32 = dict(_LLAMA31, ffn_dim=8192, rope_scaling_factor=32.0, tie_word_embeddings=True)

llama3_flavors: dict[str, TransformerModelArgs] = {
    # Small models for tests and smoke runs; vocab_size is replaced by the tokenizer's.
    "debugmodel": TransformerModelArgs(
        dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256, rope_theta=500000
    ),
    "debugmodel_wide": TransformerModelArgs(
        dim=1024, n_layers=4, n_heads=16, vocab_size=2048, multiple_of=256, rope_theta=500000
    ),
    # Mid-size (209M parameters with the test tokenizer): memory estimates checked on real ranks.
    "debugmodel_200m": TransformerModelArgs(
        dim=1024, n_layers=16, n_heads=16, vocab_size=2048, multiple_of=256, rope_theta=500000
    ),
    # Published Llama 3.2 and 3.1 hyper-parameters.
    "1B": TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, **_LLAMA32),
    "3B": TransformerModelArgs(dim=3072, n_layers=28, n_heads=24, **_LLAMA32),
    "8B": TransformerModelArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024, **_LLAMA31),
    "70B": TransformerModelArgs(
        dim=8192, n_layers=80, n_heads=64, ffn_dim_multiplier=1.3, multiple_of=4096, **_LLAMA31
    ),
    "405B": TransformerModelArgs(
        dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2, multiple_of=4096, **_LLAMA31
    ),
}

# torchtitan's names of sizes whose packed documents are kept apart (its flex and varlen kernels;
# here the device picks the kernel): the base size with a block-causal mask.
for _base, _names in {
    "debugmodel": ("debugmodel_flex_attn", "debugmodel_varlen_attn"),
    "8B": ("8B_flex", "8B_varlen"),
}.items():
    for _name in _names:
        llama3_flavors[_name] = dataclasses.replace(llama3_flavors[_base], attn_mask_type="block_causal")

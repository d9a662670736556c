"""Pure mapping between our Llama 3 state dict and Hugging Face's ``LlamaForCausalLM`` layout.

Our ``apply_rotary_emb`` rotates interleaved feature pairs (2i, 2i+1) of each head (Meta's layout);
HF's ``rotate_half`` pairs feature i with i + head_dim / 2, both at frequency i. Reordering the rows
of wq and wk per head (our row 2i -> HF row i, 2i+1 -> i + head_dim / 2) keeps the attention scores:
the usual Meta -> HF conversion. Every other tensor is copied as is.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import torch

from .model import Transformer, TransformerModelArgs, ffn_hidden_dim

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL_INV = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_IN_LAYER_INV = {hf: ours for ours, hf in _IN_LAYER.items()}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf_key(key: str) -> str:
    """HF name of our parameter ``key``; KeyError if it is not a Llama parameter."""
    if key in _TOP_LEVEL:
        return _TOP_LEVEL[key]
    match = _OURS_LAYER.fullmatch(key)
    if match and match[2] in _IN_LAYER:
        return f"model.layers.{match[1]}.{_IN_LAYER[match[2]]}"
    raise KeyError(key)


def from_hf_key(key: str) -> str:
    """Our name of the HF parameter ``key``; KeyError if it is not a Llama parameter."""
    if key in _TOP_LEVEL_INV:
        return _TOP_LEVEL_INV[key]
    match = _HF_LAYER.fullmatch(key)
    if match and match[2] in _IN_LAYER_INV:
        return f"layers.{match[1]}.{_IN_LAYER_INV[match[2]]}"
    raise KeyError(key)


def permute_for_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A wq/wk weight [n_heads * head_dim, dim] with its rows in HF's order (see the module docstring)."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def unpermute_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``permute_for_hf``."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rotary_heads(key: str, args: TransformerModelArgs) -> int | None:
    """Heads of ``key`` (our name) if it is a rotary projection (wq/wk), else None."""
    if key.endswith(".attention.wq.weight"):
        return args.n_heads
    if key.endswith(".attention.wk.weight"):
        return args.n_kv_heads or args.n_heads
    return None


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """Our (full, unsharded) tensors -> HF names and layout. Any subset of the keys is accepted."""
    out = {}
    for key, tensor in state_dict.items():
        heads = _rotary_heads(key, args)
        out[to_hf_key(key)] = permute_for_hf(tensor, heads) if heads else tensor
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """HF tensors -> our names and layout. Any subset of the keys is accepted."""
    out = {}
    for hf_key, tensor in state_dict.items():
        key = from_hf_key(hf_key)
        heads = _rotary_heads(key, args)
        out[key] = unpermute_from_hf(tensor, heads) if heads else tensor
    return out


def hf_param_shapes(args: TransformerModelArgs, tied: bool = False) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter of the full model (``lm_head`` left out when ``tied``)."""
    # A meta-device model costs no memory and keeps the shapes in one place: model.py.
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, max_seq_len=1))
    shapes = {to_hf_key(k): tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        del shapes["lm_head.weight"]
    return shapes


def hf_config(args: TransformerModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to a model built from ``args``."""
    rope_scaling = None
    if args.use_rope_scaling:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": args.max_position_embeddings or args.max_seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_section(config: dict[str, Any]) -> Any:
    """The table of an HF config's RoPE settings: transformers >= 5 nests theta and scaling in
    ``rope_parameters``, older files keep theta at the top level and scaling in ``rope_scaling``."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _rope_theta(config: dict[str, Any], rope: dict[str, Any]) -> Any:
    return rope.get("rope_theta", config.get("rope_theta"))


def _rope_args(config: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    rope = _rope_section(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        problems.append(f"rope_type {rope_type!r} is not supported (default or llama3)")
    rope_theta = _rope_theta(config, rope)
    if rope_theta is None:
        problems.append("missing field 'rope_theta'")
    fields = {"rope_theta": float(rope_theta or 0), "use_rope_scaling": rope_type == "llama3"}
    if rope_type == "llama3":
        names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        problems.extend(f"llama3 rope scaling without '{name}'" for name in names if name not in rope)
        fields["rope_scaling_factor"] = float(rope.get("factor", 0))
        fields["rope_low_freq_factor"] = float(rope.get("low_freq_factor", 0))
        fields["rope_high_freq_factor"] = float(rope.get("high_freq_factor", 0))
        fields["rope_original_max_position_embeddings"] = int(rope.get("original_max_position_embeddings", 0))
    return fields


def _value_problems(config: dict[str, Any]) -> list[str]:
    """Sizes that are not positive integers, and rates that are not positive numbers (a size of
    "4096" or 4096.0 would fail later as a TypeError inside torch)."""
    rope = _rope_section(config)
    if not isinstance(rope, dict):
        return [f"rope_scaling={rope!r} is not an object"]
    sizes = {name: config.get(name) for name in (*_REQUIRED, *_OPTIONAL_SIZES) if name != "rms_norm_eps"}
    sizes["rope_scaling.original_max_position_embeddings"] = rope.get("original_max_position_embeddings")
    rates = {"rms_norm_eps": config.get("rms_norm_eps"), "rope_theta": _rope_theta(config, rope)}
    rates |= {f"rope_scaling.{n}": rope.get(n) for n in ("factor", "low_freq_factor", "high_freq_factor")}

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

    problems = [
        f"{name}={value!r} is not a positive integer"
        for name, value in sizes.items()
        if value is not None and not (isinstance(value, int) and number(value))
    ]
    problems += [
        f"{name}={value!r} is not a positive number"
        for name, value in rates.items()
        if value is not None and not number(value)
    ]
    low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    if number(low) and number(high) and low >= high:
        problems.append(f"rope_scaling.low_freq_factor={low} is not below high_freq_factor={high}")
    return problems


_OPTIONAL_SIZES = ("num_key_value_heads", "max_position_embeddings", "head_dim")

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "rms_norm_eps",
    "intermediate_size",
)


def args_from_hf_config(
    config: dict[str, Any], base: TransformerModelArgs | None = None, source: str = "config.json"
) -> TransformerModelArgs:
    """``TransformerModelArgs`` of an HF Llama ``config``; the fields HF does not store come from
    ``base``, and ``ffn_dim`` is set only when they do not give the file's ``intermediate_size``.
    ValueError naming ``source`` and every feature of the file ours lacks (biases, ...)."""
    base = base or TransformerModelArgs()
    problems = [f"missing field '{name}'" for name in _REQUIRED if name not in config]
    # model_type: another family's file (mistral, qwen2, ...) can hold every Llama field.
    features = (("model_type", "llama"), ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
    for name, expected in features:
        if config.get(name, expected) != expected:
            problems.append(f"{name}={config[name]!r} is not supported (need {expected!r})")
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        problems.append(f"tie_word_embeddings={config['tie_word_embeddings']!r} is not true or false")
    wrong_values = _value_problems(config)
    problems += wrong_values
    rope = {} if wrong_values else _rope_args(config, problems)
    if problems:
        raise ValueError(f"{source}: {'; '.join(problems)}")
    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    args = dataclasses.replace(
        base,
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,  # our flavors' spelling of MHA
        vocab_size=config["vocab_size"],
        norm_eps=config["rms_norm_eps"],
        ffn_dim=None,
        max_position_embeddings=config.get("max_position_embeddings", base.max_position_embeddings),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        **rope,
    )
    if ffn_hidden_dim(args) != config["intermediate_size"]:
        args = dataclasses.replace(args, ffn_dim=config["intermediate_size"])
    if config.get("head_dim") not in (None, args.head_dim):  # null: derived, as transformers reads it
        raise ValueError(
            f"{source}: head_dim={config['head_dim']} but hidden_size / num_attention_heads = {args.head_dim}"
        )
    return args


# Our field -> HF config name, for messages about a file that does not match the model.
ARG_TO_HF_FIELD = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "use_rope_scaling": "rope_scaling",
    "rope_scaling_factor": "rope_scaling.factor",
    "rope_low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_original_max_position_embeddings": "rope_scaling.original_max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
}


def _compared(args: TransformerModelArgs, name: str) -> Any:
    """The value of ``args``' field ``name`` as the file would spell it."""
    if name == "n_kv_heads":
        return args.n_kv_heads or args.n_heads
    if name == "ffn_dim":
        return ffn_hidden_dim(args)
    return getattr(args, name)


def config_mismatches(file_args: TransformerModelArgs, model_args: TransformerModelArgs) -> list[str]:
    """Human-readable differences between the args read from a config and the model's args. An
    untied model may start from a tied file (its output head starts as a copy of the table)."""
    out = []
    for name, hf_name in ARG_TO_HF_FIELD.items():
        if name.startswith("rope_") and name != "rope_theta" and not model_args.use_rope_scaling:
            continue  # scaling parameters are unused without scaling
        if name == "tie_word_embeddings" and not model_args.tie_word_embeddings:
            continue
        ours, theirs = _compared(model_args, name), _compared(file_args, name)
        if ours != theirs:
            out.append(f"{hf_name}={theirs} but the model has {name}={ours}")
    return out

"""Tiny Hugging Face model folders for tests: a byte-level BPE tokenizer folder, a corpus, and
Llama config.json + safetensors files written by hand (no transformers needed)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TOKENIZER_VOCAB = 300

# What the tokenizer is trained on and the runs train on: a few kilobytes of varied English.
_SENTENCES = [
    "The model reads a token, looks at the ones before it and guesses the next.",
    "Fine-tuning starts from published weights and trains them a little further on new text.",
    "A checkpoint holds the weights, the optimizer state and where the data loader stopped.",
    "Each rank keeps a shard of every parameter and gathers the rest when it needs it.",
    "def add(x, y):\n    return x + y\n",
    "Rotary embeddings turn each pair of features by an angle that grows with the position.",
]


def corpus_text(repeats: int = 40) -> str:
    """The training corpus: the sentences, shuffled differently on each repeat."""
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(repeats):
        order = torch.randperm(len(_SENTENCES), generator=generator).tolist()
        lines.extend(_SENTENCES[i] for i in order)
    return "\n".join(lines) + "\n"


def write_tokenizer(folder: str) -> int:
    """Writes tokenizer.json and tokenizer_config.json (Llama 3's BOS/EOS names) into ``folder``;
    returns the vocabulary size (ids 0 and 1 are BOS and EOS)."""
    os.makedirs(folder, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus_text(1)], trainer)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    return tokenizer.get_vocab_size()


def llama_config(**fields) -> dict:
    """An HF Llama config.json of a tiny model (dim 64, 2 layers, 4 heads, 2 kv heads), with ``fields``."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "vocab_size": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    return {**config, **fields}


LLAMA32_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Tiny config.json's of three Llama shapes (see llama_config for the rest).
SHAPES = {
    # Llama 3.0: no RoPE scaling, an 8K context, another FFN width.
    "llama3.0": llama_config(intermediate_size=224),
    # Llama 3.2: tied embeddings, RoPE scaled by 32, a 128K context.
    "llama3.2": llama_config(tie_word_embeddings=True, max_position_embeddings=131072, rope_scaling=LLAMA32_ROPE),
    # No published size: 8 heads of 8, full multi-head attention, another FFN width, base and eps.
    "custom": llama_config(
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=160,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    ),
}


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight of the LlamaForCausalLM ``config`` describes, from the
    HF field meanings (written out here, not taken from the code under test)."""
    dim, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = dim // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, dim)
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (dim, dim),
            prefix + "self_attn.k_proj.weight": (kv, dim),
            prefix + "self_attn.v_proj.weight": (kv, dim),
            prefix + "self_attn.o_proj.weight": (dim, dim),
            prefix + "mlp.gate_proj.weight": (ffn, dim),
            prefix + "mlp.up_proj.weight": (ffn, dim),
            prefix + "mlp.down_proj.weight": (dim, ffn),
            prefix + "input_layernorm.weight": (dim,),
            prefix + "post_attention_layernorm.weight": (dim,),
        }
    return shapes


def write_llama_folder(folder: str, config: dict, drop: tuple[str, ...] = ()) -> str:
    """Writes ``config`` and random weights of its shapes (less the names in ``drop``) to
    ``folder``, with a tokenizer; returns the folder."""
    write_tokenizer(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator) * 0.05
        for name, shape in hf_shapes(config).items()
        if name not in drop
    }
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


SEQ_LEN = 64


def folder_args(folder: str, corpus: str, *extra: str) -> list[str]:
    """Options of a run on ``folder`` (weights, sizes and tokenizer) and ``corpus``, then ``extra``."""
    return [
        "--checkpoint.initial_load_path",
        folder,
        "--model.tokenizer_path",
        folder,
        "--training.dataset",
        corpus,
        "--training.seq_len",
        str(SEQ_LEN),
        *extra,
    ]


# Llama 3 Instruct's published chat template: each message in a header block ending with <|eot_id|>,
# BOS before the first.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Llama 3's named special tokens, in its id order (here from 0, before the byte-level vocabulary).
LLAMA3_CHAT_TOKENS = [
    BOS,
    EOS,
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
]
CHAT_TOKENIZER_VOCAB = 400


def write_chat_tokenizer(folder: str, chat_template: str | None = LLAMA3_CHAT_TEMPLATE) -> str:
    """Writes a Llama-3-style tokenizer folder: byte-level BPE behind Llama 3's split pattern, its special
    tokens, BOS added by the post-processor (as Llama 3's tokenizer.json does), and tokenizer_config.json
    with Llama 3 Instruct's BOS/EOS and ``chat_template`` (none when None); returns the folder."""
    from tokenizers import Regex, processors

    from trainer.data.tokenizer import LLAMA3_PATTERN

    os.makedirs(folder, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CHAT_TOKENIZER_VOCAB,
        special_tokens=LLAMA3_CHAT_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus_text(1)], trainer)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]),
        ]
    )
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": "<|eot_id|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return folder

"""The ``[generation]`` section: what ``python -m programs.generate`` completes and how it draws the
tokens (docs/generation.md). Training ignores it."""

from __future__ import annotations

from dataclasses import dataclass

from config.errors import ConfigError


@dataclass
class Generation:
    prompt: str = ""
    """A prompt to complete, given on the command line (several: prompt_file)."""
    prompt_file: str = ""
    """A file of prompts: one per line, or JSON lines (.jsonl) of {"prompt": text} or {"messages": [{role,
    content}, ...]}, the latter rendered with the tokenizer's chat template."""
    chat: bool = False
    """Each text prompt as one user message through the tokenizer folder's chat template, followed by the
    assistant's header, as transformers' apply_chat_template(add_generation_prompt=True) renders it."""
    max_new_tokens: int = 64
    """Tokens to generate per prompt at most; fewer at the end-of-text token or the context (training.seq_len)."""
    temperature: float = 0.0
    """0: the most likely token each step (greedy); above 0: drawn from softmax(logits / temperature)."""
    top_k: int = 0
    """Draw from the k most likely tokens only; 0: all."""
    top_p: float = 1.0
    """Draw from the fewest most likely tokens whose probabilities sum to top_p or more; 1: all."""
    seed: int = 0
    """The draws' seed: the same seed, prompts and checkpoint give the same tokens."""
    use_cache: bool = True
    """Keep every layer's keys and values between steps, so that each step runs the model on its new token."""
    batch_size: int = 8
    """Prompts completed together in one batch."""
    output_file: str = ""
    """Also write each completion as a JSON line {"prompt", "completion", "prompt_tokens", "tokens"}."""


def check_generation(generation: Generation) -> None:
    """The section's values out of their ranges."""
    if generation.max_new_tokens < 1:
        raise ConfigError(f"generation.max_new_tokens must be 1 or more, got {generation.max_new_tokens}")
    if generation.temperature < 0:
        raise ConfigError(f"generation.temperature must be 0 (greedy) or more, got {generation.temperature}")
    if generation.top_k < 0:
        raise ConfigError(f"generation.top_k must be 0 (all tokens) or more, got {generation.top_k}")
    if not 0 < generation.top_p <= 1:
        raise ConfigError(f"generation.top_p must be above 0 and at most 1, got {generation.top_p}")
    if generation.batch_size < 1:
        raise ConfigError(f"generation.batch_size must be 1 or more, got {generation.batch_size}")

"""Generation tasks: a greedy continuation of each context, cut at the first of its stop strings, right
when it equals the answer (lm-evaluation-harness's generate_until and exact_match as its HF backend runs
them); the in-training evaluation (trainer/evaluate.py) and the harness's adapter
(programs/lm_eval_model.py) both complete contexts here."""

from __future__ import annotations

from torch import nn

from config.evaluation import GenerationRecord
from trainer.data.tokenizer import Tokenizer
from trainer.generation import generate


def cut_at_stops(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any of ``until`` (empty ones ignored), as the harness cuts."""
    ends = [text.find(stop) for stop in until if stop]
    return text[: min((end for end in ends if end >= 0), default=len(text))]


def generation_prompt(tokenizer: Tokenizer, context: str, add_bos: bool, max_context: int) -> list[int]:
    """The ids of ``context``, its last ``max_context`` ones (the harness's left truncation); an empty
    context is the BOS token."""
    return tokenizer.encode(context, bos=add_bos)[-max_context:] or [tokenizer.bos_id]


def continuations(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    until: list[list[str]],
    *,
    max_new_tokens: int,
    batch_size: int,
    stop_at_eos: bool = True,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[str]:
    """The text each prompt continues with, ``batch_size`` prompts a ``generate`` call: its new tokens
    before the first EOS, decoded, cut at the first of its ``until``. ``stop_at_eos`` False runs every
    call ``max_new_tokens`` steps whatever comes (the same forward passes on every rank, as FSDP needs)
    and cuts at EOS after."""
    texts = []
    eos = tokenizer.eos_id
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        new = generate(
            model,
            batch,
            max_new_tokens=max_new_tokens,
            eos_id=eos if stop_at_eos else None,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
        for tokens, stops in zip(new, until[start : start + batch_size]):
            tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
            texts.append(cut_at_stops(tokenizer.decode(tokens), stops))
    return texts


def exact_matches(tasks: dict[str, list[GenerationRecord]], matches: list[float]) -> dict[str, dict[str, float]]:
    """Each task's exact_match: the share of its records whose continuation is the answer; ``matches``
    (1 or 0 a record) in the tasks' order."""
    results, at = {}, 0
    for name, records in tasks.items():
        results[name] = {"exact_match": sum(matches[at : at + len(records)]) / len(records)}
        at += len(records)
    return results

"""trainer/generation.py and the model's key/value cache (models/llama3/kv_cache.py) on a tiny model
in one process: cached forwards give the full forward's logits, greedy tokens are the argmax a plain
loop picks one prompt at a time, with the cache and without, batched and padded; sampling draws from
the distribution computed here by hand, the same tokens for the same seed."""

from __future__ import annotations

import math

import pytest
import torch

from models.llama3.kv_cache import KVCache
from models.llama3.model import Transformer, TransformerModelArgs
from tests.hf_folders import LLAMA3_CHAT_TOKENS, llama_config, write_chat_tokenizer, write_llama_folder
from trainer.generation import generate, sampling_probabilities

# Float32 on the CPU: a cached forward sums the same products as the full one, in other groupings.
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=32)
    model = Transformer(args)
    model.init_weights(seed=3)
    with torch.no_grad():
        # Initialised, attention barely moves the residual stream next to the embeddings (std 1):
        # the next token would hang on the last one alone, and attention bugs change no token.
        for layer in model.layers.values():
            for linear, scale in (("wq", 8.0), ("wk", 8.0), ("wv", 20.0), ("wo", 20.0)):
                getattr(layer.attention, linear).weight.mul_(scale)
    return model.eval()


def _reference(model: Transformer, prompt: list[int], count: int, eos_id: int | None = None) -> list[int]:
    """Greedy continuation of one prompt: the whole sequence through the model at every step."""
    sequence, new = list(prompt), []
    with torch.no_grad():
        while len(new) < count and len(sequence) < model.args.max_seq_len:
            token = int(model(torch.tensor([sequence]))[0, -1].argmax())
            sequence.append(token)
            new.append(token)
            if token == eos_id:
                break
    return new


PROMPTS = [[5, 17, 3, 40, 2, 9, 11], [8], [30, 31, 32]]


def test_cached_forwards_give_the_full_forwards_logits(model):
    tokens = torch.tensor([[5, 17, 3, 40, 2, 9, 11, 20, 7]])
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(batch=1, length=model.args.max_seq_len)
        pieces = [model(tokens[:, :5], torch.arange(5)[None], cache=cache)]
        for position in range(5, tokens.shape[1]):
            pieces.append(model(tokens[:, position : position + 1], torch.tensor([[position]]), cache=cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_tokens_are_the_argmax_of_one_prompt_at_a_time(model, use_cache):
    got = generate(model, PROMPTS, max_new_tokens=12, eos_id=None, use_cache=use_cache)
    assert got == [_reference(model, prompt, 12) for prompt in PROMPTS]
    assert all(len(new) == 12 for new in got)


def test_sequence_shards_pad_the_forwards_and_change_no_token(model):
    """Tensor parallelism splits every forward's sequence over its ranks: rows padded to a multiple."""
    expected = [_reference(model, prompt, 10) for prompt in PROMPTS]
    model.hidden_sequence_shards = 4
    try:
        for use_cache in (True, False):
            assert generate(model, PROMPTS, max_new_tokens=10, eos_id=None, use_cache=use_cache) == expected
    finally:
        del model.hidden_sequence_shards


def test_generation_stops_at_eos_and_at_the_context(model):
    free = _reference(model, PROMPTS[0], 12)
    eos = free[4]
    stopped = generate(model, [PROMPTS[0]], max_new_tokens=12, eos_id=eos)[0]
    assert stopped == free[: free.index(eos) + 1]
    long_prompt = list(range(1, 30))  # 3 positions left of the 32
    assert len(generate(model, [long_prompt], max_new_tokens=12, eos_id=None)[0]) == 3


def test_a_prompt_longer_than_the_context_is_refused(model):
    with pytest.raises(ValueError, match="prompt 1 has 33 tokens; the model takes 1 to 32"):
        generate(model, [[1], [1] * 33], max_new_tokens=1, eos_id=None)


def test_sampling_is_the_same_for_a_seed_with_the_cache_and_without(model):
    options = dict(max_new_tokens=10, eos_id=None, temperature=1.5, top_k=20, top_p=0.9)
    first = generate(model, PROMPTS, seed=7, **options)
    assert generate(model, PROMPTS, seed=7, **options) == first
    assert generate(model, PROMPTS, seed=7, use_cache=False, **options) == first
    assert generate(model, PROMPTS, seed=8, **options) != first


LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])


def _softmax(values: list[float]) -> list[float]:
    weights = [math.exp(v) for v in values]
    return [w / sum(weights) for w in weights]


def test_temperature_divides_the_logits():
    expected = _softmax([4.0, 2.0, 0.0, -2.0])  # logits / 0.5
    torch.testing.assert_close(sampling_probabilities(LOGITS, 0.5)[0], torch.tensor(expected))
    assert sampling_probabilities(LOGITS, 0.0) is None  # greedy


def test_top_k_keeps_the_k_most_likely():
    expected = _softmax([2.0, 1.0]) + [0.0, 0.0]
    torch.testing.assert_close(sampling_probabilities(LOGITS, 1.0, top_k=2)[0], torch.tensor(expected))


def test_top_p_keeps_the_fewest_that_reach_it():
    p = _softmax([2.0, 1.0, 0.0, -1.0])  # 0.644, 0.237, 0.087, 0.032
    # 0.644 < 0.85: the second token is needed; 0.881 >= 0.85: the third is not.
    expected = [p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1]), 0.0, 0.0]
    torch.testing.assert_close(sampling_probabilities(LOGITS, 1.0, top_p=0.85)[0], torch.tensor(expected))
    # top_k, then top_p over what is left: 0.731 of the two reaches 0.7 alone.
    torch.testing.assert_close(
        sampling_probabilities(LOGITS, 1.0, top_k=2, top_p=0.7)[0], torch.tensor([1.0, 0.0, 0.0, 0.0])
    )


def test_sampled_tokens_follow_the_distribution():
    """20,000 draws of the tempered top-k distribution: each frequency within 4 standard errors."""
    probabilities = sampling_probabilities(LOGITS.repeat(20_000, 1), 2.0, top_k=3)
    draws = torch.multinomial(probabilities, 1, generator=torch.Generator().manual_seed(0))[:, 0]
    expected = _softmax([1.0, 0.5, 0.0]) + [0.0]
    for token, p in enumerate(expected):
        frequency = float((draws == token).float().mean())
        assert abs(frequency - p) <= 4 * math.sqrt(p * (1 - p) / 20_000) + 1e-9


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    return write_llama_folder(str(tmp_path_factory.mktemp("generate_inputs")), llama_config())


def _refusal(capsys, monkeypatch, folder: str, *options: str) -> str:
    """The error line of ``python -m programs.generate`` on ``folder`` with ``options``: exit 2, nothing loaded."""
    from programs import generate as program

    monkeypatch.setattr(program, "load_model", lambda *_: pytest.fail("the model was loaded"))
    argv = ["--checkpoint.initial_load_path", folder, "--model.tokenizer_path", folder, "--training.seq_len", "16"]
    assert program.main(argv + list(options)) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    return error


def test_a_prompt_longer_than_the_context_exits_2(hf_folder, capsys, monkeypatch):
    error = _refusal(
        capsys, monkeypatch, hf_folder, "--generation.prompt", "The model reads a token, looks at the ones before it"
    )
    assert error == (
        "error: generation.prompt: the prompt has 34 tokens, more than the model's context of 16 (training.seq_len)\n"
    )


def test_a_missing_prompt_file_exits_2(hf_folder, capsys, monkeypatch, tmp_path):
    missing = str(tmp_path / "prompts.txt")
    assert _refusal(capsys, monkeypatch, hf_folder, "--generation.prompt_file", missing) == (
        f"error: generation.prompt_file: {missing} not found\n"
    )


def test_a_folder_of_another_model_size_exits_2(hf_folder, capsys, monkeypatch):
    error = _refusal(capsys, monkeypatch, hf_folder, "--generation.prompt", "The model", "--model.ffn_dim", "256")
    assert error.startswith(f"error: checkpoint.initial_load_path: HF checkpoint: {hf_folder}/config.json does not")
    assert "intermediate_size" in error


def test_a_text_prompt_under_generation_chat_is_one_user_message(tmp_path):
    from config.manager import load_config
    from programs.generate import Prompt, encode_prompts
    from trainer.data.tokenizer import load_tokenizer

    folder = write_chat_tokenizer(str(tmp_path / "chat"))
    config = load_config(["--model.tokenizer_path", folder, "--generation.chat"])
    text = "What does a checkpoint hold?"
    as_text, as_chat = encode_prompts(
        [Prompt("a", text=text), Prompt("b", messages=[{"role": "user", "content": text}])],
        load_tokenizer(folder),
        config,
    )
    assert as_text == as_chat
    tokenizer = load_tokenizer(folder)
    start_header = LLAMA3_CHAT_TOKENS.index("<|start_header_id|>")
    last_header = len(as_text) - 1 - as_text[::-1].index(start_header)
    assert as_text[0] == tokenizer.bos_id  # the template's BOS, once
    assert tokenizer.decode(as_text[last_header:]) == "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_a_chat_prompt_without_a_chat_template_exits_2(tmp_path, capsys, monkeypatch):
    folder = write_llama_folder(str(tmp_path / "no_template"), llama_config())
    error = _refusal(capsys, monkeypatch, folder, "--generation.prompt", "Hello", "--generation.chat")
    assert error.startswith("error: generation.chat (chat prompts need a tokenizer folder with a chat template): ")

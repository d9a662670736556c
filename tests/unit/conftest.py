"""Shared fixtures for the tokenizer and data tests."""

from __future__ import annotations

import pytest

from trainer.data.tokenizer import Tokenizer, default_tokenizer

DEFAULT_VOCAB_SIZE = 2048


class CharTokenizer(Tokenizer):
    """Test tokenizer: one token per ASCII character, id = ``ord(char)``;
    BOS = 1, EOS = 2. Counts ``encode`` calls to observe caching."""

    def __init__(self) -> None:
        super().__init__(path="", vocab_size=128, bos_id=1, eos_id=2, fingerprint="char-tokenizer")
        self.encode_calls = 0

    def _encode_text(self, text: str) -> list[int]:
        self.encode_calls += 1
        return [ord(char) for char in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i > 2)


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="session")
def default_tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Cache dir holding the default tokenizer, trained once per test session."""
    cache_dir = str(tmp_path_factory.mktemp("tokenizer_cache"))
    default_tokenizer(cache_dir, DEFAULT_VOCAB_SIZE)
    return cache_dir


@pytest.fixture(scope="session")
def session_default_tokenizer(default_tokenizer_cache: str) -> Tokenizer:
    return default_tokenizer(default_tokenizer_cache, DEFAULT_VOCAB_SIZE)

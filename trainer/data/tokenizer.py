"""Tokenizers: sentencepiece and tiktoken (Llama 3) files, Hugging Face tokenizer folders, and a
default sentencepiece BPE trained on the interpreter's own documentation (no download needed)."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import itertools
import json
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import sentencepiece as spm
import tiktoken
import tokenizers

from config.errors import first_line
from trainer.data.corpus import create_file_once, default_corpus_texts

# Pre-tokenizer regex of the Llama 3 tokenizer.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The 256 Llama 3 special tokens in id order (their ids follow the base vocabulary).
_LLAMA3_SPECIAL_TOKENS = [
    *(
        "<|begin_of_text|> <|end_of_text|> <|reserved_special_token_0|> <|reserved_special_token_1|> "
        "<|reserved_special_token_2|> <|reserved_special_token_3|> <|start_header_id|> <|end_header_id|> "
        "<|reserved_special_token_4|> <|eot_id|>"
    ).split(),
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
]

# Hugging Face tokenizer folders (torchtitan's `model.hf_assets_path`).
HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
MODEL_FILE = "tokenizer.model"  # Hugging Face's name for a sentencepiece or tiktoken file
# tokenizer_config.json keys registered as special tokens, in torchtitan's order (it decides new ids).
_HF_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
# Tried in order when tokenizer_config.json does not name a BOS/EOS token.
_HF_FALLBACK_TOKENS = {"bos_token": ("<|begin_of_text|>", "<s>"), "eos_token": ("<|end_of_text|>", "</s>")}
# Part of the fingerprint: bump when the files-to-ids mapping of this module changes.
_HF_ENCODING_VERSION = b"tessera-hf-tokenizer-v1"

# Bump the version when the recipe or the corpus extraction changes: no stale cached model is reused.
_DEFAULT_MODEL_VERSION = 1
_DEFAULT_MAX_TRAINING_LINES = 200_000
_DEFAULT_MAX_LINE_CHARS = 1_000

# Threads of a batch encoding in this process; 0: one per core.
_encode_threads = 0


def limit_encode_threads(threads: int) -> None:
    """Batch encodings in this process use ``threads`` threads: a pool of processes that each encode
    supplies the parallelism itself. (``tokenizers`` reads its setting from the environment.)"""
    global _encode_threads
    _encode_threads = threads
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads != 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def encode_threads() -> int:
    return _encode_threads or os.cpu_count() or 1


class Tokenizer(ABC):
    """Text to ids in ``[0, vocab_size)`` and back; ``fingerprint`` keys the tokenized corpora."""

    def __init__(self, *, path: str, vocab_size: int, bos_id: int, eos_id: int, fingerprint: str) -> None:
        self.path = path  # the file or folder it is read from
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.fingerprint = fingerprint

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text without BOS/EOS; subclasses use their library's batch encoding."""
        return [self._encode_text(text) for text in texts]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._encode_text(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str) -> None:
        model_bytes = Path(path).read_bytes()
        self._processor = _load_sentencepiece(model_bytes, path)
        bos_id, eos_id = self._processor.bos_id(), self._processor.eos_id()
        if bos_id < 0 or eos_id < 0:
            raise ValueError(f"sentencepiece model {path} has no BOS or EOS token")
        super().__init__(
            path=path,
            vocab_size=self._processor.vocab_size(),
            bos_id=bos_id,
            eos_id=eos_id,
            fingerprint=hashlib.sha256(model_bytes).hexdigest(),
        )

    def _encode_text(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(texts, num_threads=encode_threads())

    def decode(self, ids: list[int]) -> str:
        return self._processor.decode(ids)


class TiktokenTokenizer(Tokenizer):
    """A Llama 3 ``tokenizer.model`` (tiktoken); the 256 special tokens follow the base vocabulary."""

    def __init__(self, path: str) -> None:
        model_bytes = Path(path).read_bytes()
        ranks = _parse_tiktoken_ranks(model_bytes, path)
        num_base_tokens = len(ranks)
        special_tokens = {name: num_base_tokens + offset for offset, name in enumerate(_LLAMA3_SPECIAL_TOKENS)}
        self._encoding = tiktoken.Encoding(
            name=f"tessera:{os.path.basename(path)}",
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=special_tokens,
        )
        super().__init__(
            path=path,
            vocab_size=num_base_tokens + len(_LLAMA3_SPECIAL_TOKENS),
            bos_id=special_tokens["<|begin_of_text|>"],
            eos_id=special_tokens["<|end_of_text|>"],
            fingerprint=hashlib.sha256(model_bytes).hexdigest(),
        )

    def _encode_text(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)  # special-token text in documents is plain text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts, num_threads=encode_threads())

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)  # invalid UTF-8 becomes U+FFFD


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face folder or its ``tokenizer.json``. Vocabulary size and BOS/EOS ids are torchtitan's: the
    config's special tokens are registered, new ones taking the next free ids; ids with gaps raise the
    size to the largest id + 1. Special-token text in documents is plain text."""

    def __init__(self, path: str) -> None:
        json_path, config_path = hf_tokenizer_files(path)
        self._json_path = json_path
        json_bytes = Path(json_path).read_bytes()
        config_bytes = Path(config_path).read_bytes() if os.path.isfile(config_path) else b""
        config = _parse_hf_config(config_bytes, config_path)
        self._tokenizer = _parse_hf_tokenizer(json_bytes, json_path)
        _register_hf_special_tokens(self._tokenizer, config)
        self._tokenizer.encode_special_tokens = True
        folder = os.path.dirname(json_path)
        largest_id = max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
        digest = hashlib.sha256(_HF_ENCODING_VERSION)
        for content in (json_bytes, config_bytes):
            digest.update(hashlib.sha256(content).digest())
        super().__init__(
            path=path,
            vocab_size=max(self._tokenizer.get_vocab_size(with_added_tokens=True), largest_id + 1),
            bos_id=_hf_special_token_id(self._tokenizer, config, "bos_token", folder),
            eos_id=_hf_special_token_id(self._tokenizer, config, "eos_token", folder),
            fingerprint=digest.hexdigest(),
        )

    def _encode_text(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            return [encoding.ids for encoding in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        except Exception as error:  # the library raises a bare Exception (a WordLevel model without [UNK], say)
            raise ValueError(f"tokenizer {self._json_path} cannot encode its text: {first_line(error)}") from None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A pickled tokenizers.Tokenizer forgets this setting.
        self.__dict__.update(state)
        self._tokenizer.encode_special_tokens = True

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def encode_rendered_chats(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Ids and character offsets of chats rendered by the folder's chat template: the special-token text the
        template writes is recognised (as transformers' ``apply_chat_template`` does) and no BOS/EOS is added."""
        try:
            encodings = self._chat_tokenizer.encode_batch(texts, add_special_tokens=False)
        except Exception as error:  # the library raises a bare Exception
            raise ValueError(f"tokenizer {self._json_path} cannot encode a chat: {first_line(error)}") from None
        return [(encoding.ids, encoding.offsets) for encoding in encodings]

    @functools.cached_property
    def _chat_tokenizer(self) -> tokenizers.Tokenizer:
        chat_tokenizer = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
        chat_tokenizer.encode_special_tokens = False
        # Without special tokens to add, a post-processor only trims offsets: untrimmed, a token's offsets
        # cover every character it encodes, which the assistant mask relies on.
        chat_tokenizer.post_processor = None
        return chat_tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer of the format found (a folder with only ``tokenizer.model`` loads that file)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path not found: {path}")
    model_file = os.path.join(path, MODEL_FILE)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, HF_TOKENIZER_FILE)) and os.path.isfile(model_file):
        path = model_file  # a folder of that file alone: an export of the default tokenizer, Llama 2's
    if os.path.isdir(path) or path.endswith(".json"):
        return HuggingFaceTokenizer(path)
    model_bytes = Path(path).read_bytes()
    if _looks_like_tiktoken(model_bytes):
        return TiktokenTokenizer(path)
    try:
        _load_sentencepiece(model_bytes, path)
    except ValueError:
        raise ValueError(
            f"unrecognised tokenizer file {path}: expected a sentencepiece .model, a tiktoken BPE file "
            "('base64-token rank' lines), a Hugging Face tokenizer.json or a folder holding one"
        ) from None
    return SentencePieceTokenizer(path)


def default_tokenizer(cache_dir: str, vocab_size: int = 2048) -> Tokenizer:
    """Sentencepiece BPE trained on the default corpus on first use; concurrent ranks wait for one."""
    path = default_tokenizer_path(cache_dir, vocab_size)
    create_file_once(path, lambda tmp_path: _train_default_model(tmp_path, vocab_size))
    try:
        return SentencePieceTokenizer(path)
    except ValueError as e:  # cut short or overwritten since it was trained
        raise ValueError(f"the default tokenizer's cached file is damaged ({e}); delete it and it is rebuilt") from None


def default_tokenizer_path(cache_dir: str, vocab_size: int) -> str:
    """Cache path of the default tokenizer; the corpus depends on the Python version."""
    python_version = "{}.{}.{}".format(*sys.version_info[:3])
    name = f"python_docs_bpe{vocab_size}_v{_DEFAULT_MODEL_VERSION}_py{python_version}.model"
    return os.path.join(cache_dir, name)


def build_tokenizer(path: str, cache_dir: str, vocab_size: int = 2048) -> Tokenizer:
    if not path:
        return default_tokenizer(cache_dir, vocab_size)
    return load_tokenizer(path)


def hf_tokenizer_files(path: str) -> tuple[str, str]:
    """Paths of ``tokenizer.json`` and ``tokenizer_config.json`` (which may not exist)."""
    if os.path.isdir(path):
        json_path = os.path.join(path, HF_TOKENIZER_FILE)
        if not os.path.isfile(json_path):
            raise FileNotFoundError(f"tokenizer folder {path} has no {HF_TOKENIZER_FILE}")
    elif os.path.exists(path):
        json_path = path
    else:
        raise FileNotFoundError(f"tokenizer path not found: {path}")
    return json_path, os.path.join(os.path.dirname(json_path), HF_CONFIG_FILE)


def _parse_hf_tokenizer(json_bytes: bytes, path: str) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_buffer(json_bytes)
    except Exception as error:  # the library raises a bare Exception
        reason = first_line(error).removeprefix("Cannot instantiate Tokenizer from buffer: ")
        raise ValueError(f"cannot parse Hugging Face tokenizer file {path}: {reason}") from None


def _parse_hf_config(config_bytes: bytes, path: str) -> dict[str, Any]:
    try:
        return json.loads(config_bytes) if config_bytes else {}
    except ValueError as error:  # UnicodeDecodeError is one too
        raise ValueError(f"cannot parse {path}: {error}") from None


def _hf_config_token(config: dict[str, Any], key: str) -> str | None:
    """Token named by ``config[key]``: a string or a ``{"content": ...}`` object."""
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


def _register_hf_special_tokens(tokenizer: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """As torchtitan does: the named keys, then ``added_tokens_decoder`` in file order, in one call."""
    added: list[tokenizers.AddedToken] = []
    for key in _HF_SPECIAL_TOKEN_KEYS:
        content = _hf_config_token(config, key)
        if content is not None:
            added.append(_hf_added_token(content, config[key]))
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str):
            added.append(_hf_added_token(entry["content"], entry))
    if added:
        tokenizer.add_special_tokens(added)


def _hf_added_token(content: str, entry: Any) -> tokenizers.AddedToken:
    if not isinstance(entry, dict):
        return tokenizers.AddedToken(content, special=True)
    return tokenizers.AddedToken(
        content,
        single_word=bool(entry.get("single_word", False)),
        lstrip=bool(entry.get("lstrip", False)),
        rstrip=bool(entry.get("rstrip", False)),
        normalized=bool(entry.get("normalized", True)),
        special=bool(entry.get("special", True)),
    )


def _hf_special_token_id(tokenizer: tokenizers.Tokenizer, config: dict[str, Any], key: str, folder: str) -> int:
    """Id of the BOS/EOS token (``key``): the config's, else a well-known one."""
    named = _hf_config_token(config, key)
    candidates = (named,) if named is not None else _HF_FALLBACK_TOKENS[key]
    for content in candidates:
        token_id = tokenizer.token_to_id(content)
        if token_id is not None:
            return token_id
    kind = key.split("_")[0].upper()
    raise ValueError(
        f"tokenizer {folder or '.'}: cannot find its {kind} token "
        f"({HF_CONFIG_FILE} names none and the vocabulary has none of {', '.join(candidates)})"
    )


def _load_sentencepiece(model_bytes: bytes, path: str) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(model_bytes)
    except RuntimeError:
        # The library's message is a C++ source location, so give our own.
        raise ValueError(f"cannot load sentencepiece model {path}: not a valid model file") from None
    return processor


def _looks_like_tiktoken(model_bytes: bytes) -> bool:
    first_line = model_bytes.split(b"\n", 1)[0]
    parts = first_line.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except binascii.Error:
        return False
    return True


def _parse_tiktoken_ranks(model_bytes: bytes, path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(model_bytes.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}:{line_number}: expected 'base64-token rank'") from None
        ranks[token] = rank  # a duplicate leaves a gap in the ranks
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"tiktoken file {path}: ranks must be exactly 0..{len(ranks) - 1}")
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        # Without all single bytes some texts have no encoding (tiktoken panics).
        raise ValueError(f"tiktoken file {path}: {len(missing_bytes)} of the 256 single-byte tokens are missing")
    return ranks


# An export's tokenizer_config.json: with it, transformers' AutoTokenizer gives BOS, then these ids.
DEFAULT_TOKENIZER_HF_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,  # as training frames each document
    "add_eos_token": False,
    "unk_token": "<unk>",  # sentencepiece's pieces of the ids _train_default_model gives them
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "legacy": False,
    "add_prefix_space": False,  # no dummy prefix
}


def _train_default_model(output_path: str, vocab_size: int) -> None:
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(default_corpus_texts()),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            # Identity normalization without dummy prefix: decode(encode(s)) == s.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,  # code indentation
            split_digits=True,
            byte_fallback=True,
            character_coverage=0.9995,
            # Bounded, unshuffled input and one thread: deterministic and fast.
            input_sentence_size=_DEFAULT_MAX_TRAINING_LINES,
            shuffle_input_sentence=False,
            max_sentence_length=4 * _DEFAULT_MAX_LINE_CHARS,  # bytes; UTF-8 <= 4 per char
            num_threads=1,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            minloglevel=2,  # errors only
        )
    except RuntimeError as error:
        reason = str(error).rsplit("] ", 1)[-1]  # drop the C++ source location
        raise ValueError(f"cannot train the default tokenizer with vocab_size={vocab_size}: {reason}") from None
    with open(output_path, "wb") as f:
        f.write(model.getvalue())


def _training_lines(texts: Iterable[str]) -> Iterator[str]:
    """Non-blank lines of ``texts``, truncated, at most the training line budget."""
    lines = (line[:_DEFAULT_MAX_LINE_CHARS] for text in texts for line in text.split("\n") if line.strip())
    return itertools.islice(lines, _DEFAULT_MAX_TRAINING_LINES)

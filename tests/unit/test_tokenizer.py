"""Tests of trainer.data.tokenizer."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from config.job_config import DEFAULT_TOKENIZER_MIN_VOCAB
from config.manager import load_config
from models.llama3 import Transformer
from tests.unit.conftest import DEFAULT_VOCAB_SIZE
from tests.unit.test_model import tiny_args
from trainer.checkpoint.hf import export_hf, job_export_assets
from trainer.data.tokenizer import (
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
    default_tokenizer,
    default_tokenizer_path,
    load_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Merges of the tiny tiktoken file, after the 256 single bytes (rank = byte).
TINY_MERGES = [b"he", b"ll", b"llo", b" w"]
TINY_BASE_VOCAB = 256 + len(TINY_MERGES)


def write_tiktoken_file(path: Path, tokens: list[bytes]) -> Path:
    lines = [f"{base64.b64encode(token).decode()} {rank}" for rank, token in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_tiktoken_file(tmp_path: Path) -> Path:
    single_bytes = [bytes([b]) for b in range(256)]
    return write_tiktoken_file(tmp_path / "tokenizer.model", single_bytes + TINY_MERGES)


# --- default sentencepiece tokenizer ---------------------------------------


def test_default_tokenizer_round_trips_any_text(session_default_tokenizer: Tokenizer) -> None:
    tokenizer = session_default_tokenizer
    text = "def f(x):\n    return x  +  1\n\n\tTabs, é, 中文, 🙂 and <|endoftext|>  "
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_default_tokenizer_special_ids_and_flags(session_default_tokenizer: Tokenizer) -> None:
    tokenizer = session_default_tokenizer
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (DEFAULT_VOCAB_SIZE, 1, 2)
    ids = tokenizer.encode("Return the value.")
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
    assert tokenizer.encode("Return the value.", bos=True) == [1, *ids]
    assert tokenizer.encode("Return the value.", eos=True) == [*ids, 2]
    assert tokenizer.encode("Return the value.", bos=True, eos=True) == [1, *ids, 2]


def test_default_tokenizer_compresses_its_corpus(session_default_tokenizer: Tokenizer) -> None:
    # Learned merges: common docstring words take far fewer tokens than bytes.
    text = "Return a new dictionary with the keys of the given object."
    assert len(session_default_tokenizer.encode(text)) < len(text) / 3


def test_build_tokenizer_default_reuses_cached_model(
    default_tokenizer_cache: str, session_default_tokenizer: Tokenizer
) -> None:
    path = default_tokenizer_path(default_tokenizer_cache, DEFAULT_VOCAB_SIZE)
    modified = os.path.getmtime(path)
    tokenizer = build_tokenizer("", default_tokenizer_cache, DEFAULT_VOCAB_SIZE)
    assert tokenizer.fingerprint == session_default_tokenizer.fingerprint
    assert os.path.getmtime(path) == modified
    # One spelling: "default" is a path like any other (it also meant the default tokenizer here,
    # but not to the export, which copied a file of that name, nor to the pre-launch check).
    with pytest.raises(FileNotFoundError, match="tokenizer path not found: default"):
        build_tokenizer("default", default_tokenizer_cache, DEFAULT_VOCAB_SIZE)
    assert f"bpe{DEFAULT_VOCAB_SIZE}" in path and "py{}.{}".format(*sys.version_info[:2]) in path


def test_an_export_of_the_default_tokenizer_frames_text_as_training_does_in_transformers(
    tmp_path: Path, default_tokenizer_cache: str, session_default_tokenizer: Tokenizer
) -> None:
    """The export's tokenizer.model and tokenizer_config.json: transformers' AutoTokenizer gives
    BOS and then this tokenizer's ids, spaces, tabs and non-ASCII included (without the
    tokenizer_config.json, AutoTokenizer gives no BOS)."""
    transformers = pytest.importorskip("transformers")
    options = [
        "--job.cache_dir",
        default_tokenizer_cache,
        "--model.default_tokenizer_vocab_size",
        str(DEFAULT_VOCAB_SIZE),
    ]
    tokenizer = session_default_tokenizer
    args = tiny_args(vocab_size=DEFAULT_VOCAB_SIZE)
    model = Transformer(args)
    model.init_weights()
    export = str(tmp_path / "hf")
    assets = job_export_assets(load_config(options), tokenizer.bos_id, tokenizer.eos_id)
    export_hf([model], args, export, torch.float32, assets=assets)
    loaded = transformers.AutoTokenizer.from_pretrained(export)
    for text in ("Hello world, def f(x): return x", "  two  spaces\nnewline\ttab", "ünïcödé 漢字"):
        assert loaded(text)["input_ids"] == tokenizer.encode(text, bos=True), text


def test_default_tokenizer_with_too_small_vocab(
    tmp_path: Path,
    session_default_tokenizer: Tokenizer,  # corpus already parsed in this process
) -> None:
    """The config's floor is the trainer's own: one vocabulary entry less fails."""
    below = DEFAULT_TOKENIZER_MIN_VOCAB - 1
    with pytest.raises(ValueError, match=f"vocab_size={below}: .* {below} vs {DEFAULT_TOKENIZER_MIN_VOCAB}\\."):
        default_tokenizer(str(tmp_path), below)
    assert not Path(default_tokenizer_path(str(tmp_path), below)).exists()


def test_a_damaged_default_tokenizer_file_is_named_with_the_cure(tmp_path: Path) -> None:
    """The default tokenizer's cached file cut short: named as damaged, with "delete it" (the line
    blamed model.tokenizer_path, which the user had not set)."""
    path = Path(default_tokenizer_path(str(tmp_path), DEFAULT_VOCAB_SIZE))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x0a\x05cut")
    with pytest.raises(ValueError, match="default tokenizer's cached file is damaged .*; delete it and it is rebuilt"):
        default_tokenizer(str(tmp_path), DEFAULT_VOCAB_SIZE)


@pytest.mark.slow  # two Python processes racing for the cache lock
def test_default_tokenizer_trained_once_across_processes(tmp_path: Path) -> None:
    cache_dir, ready_dir = tmp_path / "cache", tmp_path / "ready"
    ready_dir.mkdir()
    trainings = tmp_path / "trainings.log"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        import trainer.data.tokenizer as tokenizer_module
        from pydoc_data.topics import topics

        # The help topics alone train quickly; the file locking is under test.
        tokenizer_module.default_corpus_texts = lambda: iter(sorted(topics.values()))
        train = tokenizer_module._train_default_model

        def slow_logged_train(path, vocab_size):
            with open({str(trainings)!r}, "a") as log:
                log.write("trained\\n")
            time.sleep(1.0)  # keeps the other process waiting on the lock
            train(path, vocab_size)

        tokenizer_module._train_default_model = slow_logged_train
        # Barrier: both processes call default_tokenizer at the same moment.
        open(os.path.join({str(ready_dir)!r}, sys.argv[1]), "w").close()
        while len(os.listdir({str(ready_dir)!r})) < 2:
            time.sleep(0.01)
        print(tokenizer_module.default_tokenizer({str(cache_dir)!r}, 512).fingerprint)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    fingerprints = {stdout.strip() for stdout, _ in outputs}
    assert len(fingerprints) == 1
    assert trainings.read_text() == "trained\n"
    model_path = Path(default_tokenizer_path(str(cache_dir), 512))
    assert load_tokenizer(str(model_path)).fingerprint == fingerprints.pop()
    assert sorted(p.name for p in cache_dir.iterdir()) == [model_path.name, model_path.name + ".lock"]


# --- tiktoken --------------------------------------------------------------


def test_tiktoken_encodes_like_hand_computed_bpe(tiny_tiktoken_file: Path) -> None:
    tokenizer = TiktokenTokenizer(str(tiny_tiktoken_file))
    # "hello": h,e,l,l,o -> he (256) -> ll (257) -> llo (258) -> [he, llo];
    # " world": " w" (259) then the single bytes o, r, l, d.
    assert tokenizer.encode("hello world") == [256, 258, 259, ord("o"), ord("r"), ord("l"), ord("d")]
    assert tokenizer.decode([256, 258, 259]) == "hello w"


def test_tiktoken_special_tokens_follow_base_vocab(tiny_tiktoken_file: Path) -> None:
    tokenizer = TiktokenTokenizer(str(tiny_tiktoken_file))
    assert tokenizer.vocab_size == TINY_BASE_VOCAB + 256
    assert (tokenizer.bos_id, tokenizer.eos_id) == (TINY_BASE_VOCAB, TINY_BASE_VOCAB + 1)
    assert tokenizer.decode([TINY_BASE_VOCAB + 6, TINY_BASE_VOCAB + 7, TINY_BASE_VOCAB + 9]) == (
        "<|start_header_id|><|end_header_id|><|eot_id|>"
    )
    assert tokenizer.decode([TINY_BASE_VOCAB + 255]) == "<|reserved_special_token_250|>"
    ids = tokenizer.encode("hello", bos=True, eos=True)
    assert ids == [TINY_BASE_VOCAB, 256, 258, TINY_BASE_VOCAB + 1]


def test_tiktoken_treats_special_token_text_as_plain_text(tiny_tiktoken_file: Path) -> None:
    tokenizer = TiktokenTokenizer(str(tiny_tiktoken_file))
    text = "<|begin_of_text|>x<|endoftext|>"
    ids = tokenizer.encode(text)
    assert all(i < TINY_BASE_VOCAB for i in ids)
    assert tokenizer.decode(ids) == text


def test_tiktoken_round_trips_long_and_unicode_text(tiny_tiktoken_file: Path) -> None:
    tokenizer = TiktokenTokenizer(str(tiny_tiktoken_file))
    texts = [
        "Grüße, 中文 🙂\r\n\tend",
        "a" + " " * 100_000 + "b",  # tiktoken's regex backtracks on long whitespace runs
        "x" * 60_000,
        "hello world\n" * 80_000,  # longer than one 400k-char encode chunk
    ]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text


# --- format detection and errors -------------------------------------------


def test_load_tokenizer_detects_format(tiny_tiktoken_file: Path, default_tokenizer_cache: str) -> None:
    assert isinstance(load_tokenizer(str(tiny_tiktoken_file)), TiktokenTokenizer)
    sentencepiece_path = default_tokenizer_path(default_tokenizer_cache, DEFAULT_VOCAB_SIZE)
    assert isinstance(load_tokenizer(sentencepiece_path), SentencePieceTokenizer)
    assert isinstance(build_tokenizer(str(tiny_tiktoken_file), "unused"), TiktokenTokenizer)


def test_missing_tokenizer_file_names_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_tokenizer(missing, str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"\x00\xffgarbage", b"hello world\n", b'{"model": "bpe"}'])
def test_unrecognised_tokenizer_file_names_path(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "weird.model"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="unrecognised tokenizer file .*weird.model"):
        load_tokenizer(str(path))


def test_tokenizer_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_a_folder_of_a_tokenizer_model_alone_loads_it(tiny_tiktoken_file: Path) -> None:
    """An export of the default tokenizer (or Llama 2's folder) holds tokenizer.model and no
    tokenizer.json: the folder loads as that file (it was refused: no tokenizer.json)."""
    from_folder, from_file = load_tokenizer(str(tiny_tiktoken_file.parent)), load_tokenizer(str(tiny_tiktoken_file))
    text = "hello world, hello"
    assert from_folder.encode(text) == from_file.encode(text) and from_folder.vocab_size == from_file.vocab_size


def test_malformed_tiktoken_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_tiktoken_file(tmp_path / "bad.model", [bytes([b]) for b in range(256)])
    lines = path.read_text().splitlines()
    lines[2] = "not-base64!! 2"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"bad.model:3:"):
        load_tokenizer(str(path))


def test_tiktoken_file_without_all_single_bytes(tmp_path: Path) -> None:
    path = write_tiktoken_file(tmp_path / "small.model", [b"a", b"b", b"ab"])
    with pytest.raises(ValueError, match="small.model.*single-byte"):
        load_tokenizer(str(path))


def test_tiktoken_file_with_gaps_in_ranks(tmp_path: Path) -> None:
    path = tmp_path / "gaps.model"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {2 * b}\n" for b in range(256)))
    with pytest.raises(ValueError, match="gaps.model.*ranks"):
        load_tokenizer(str(path))


# --- Hugging Face tokenizer folders ----------------------------------------

ANCHOR_TOKENIZER = REPO_ROOT.parent / "shared" / "anchors" / "torchtitan-v0.2.2" / "assets" / "tokenizer"
HF_TRAINING_TEXTS = [
    "The cat sat on the mat.\n",
    "def add(x, y):\n    return x + y\n",
    "Tokenizers split text into pieces; the pieces map to ids.",
] * 4
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"


def train_hf_tokenizer(special_tokens: list[str]) -> tokenizers.Tokenizer:
    """Tiny byte-level BPE whose post-processor would frame every text with the
    first special token, as Llama 3's tokenizer.json does."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(HF_TRAINING_TEXTS, trainer)
    first = special_tokens[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A", special_tokens=[(first, tokenizer.token_to_id(first))]
    )
    return tokenizer


def write_hf_folder(folder: Path, tokenizer: tokenizers.Tokenizer, config: dict | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    """Folder with Llama 3 style special tokens named in tokenizer_config.json,
    as a string (BOS) and as an object (EOS)."""
    tokenizer = train_hf_tokenizer([LLAMA3_BOS, LLAMA3_EOS, "<|pad|>"])
    config = {"bos_token": LLAMA3_BOS, "eos_token": {"content": LLAMA3_EOS, "special": True}}
    return write_hf_folder(tmp_path / "hf", tokenizer, config)


def test_hf_tokenizer_round_trips_text(hf_folder: Path) -> None:
    tokenizer = build_tokenizer(str(hf_folder), "unused")
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    text = "def f(x):\n    return x  +  1\n\n\tTabs, é, 中文, 🙂 and spaces  "
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert len(tokenizer.encode("The cat sat on the mat.")) < len("The cat sat on the mat.") / 2


def test_hf_tokenizer_frames_only_when_asked(hf_folder: Path) -> None:
    tokenizer = load_tokenizer(str(hf_folder))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    ids = tokenizer.encode("The cat sat.")  # the post-processor's BOS is not added
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
    assert tokenizer.encode("The cat sat.", bos=True, eos=True) == [0, *ids, 1]
    assert tokenizer.decode([0, *ids, 1]) == f"{LLAMA3_BOS}The cat sat.{LLAMA3_EOS}"


def test_hf_tokenizer_treats_special_token_text_as_plain_text(hf_folder: Path) -> None:
    tokenizer = load_tokenizer(str(hf_folder))
    text = f"a{LLAMA3_EOS}b<|pad|>"
    ids = tokenizer.encode(text)
    assert not {0, 1, 2} & set(ids)
    assert tokenizer.decode(ids) == text


def test_hf_vocab_size_counts_config_tokens_like_torchtitan(tmp_path: Path) -> None:
    # Tokens named only in tokenizer_config.json get the next free ids, whatever
    # id added_tokens_decoder gives them (torchtitan's HuggingFaceTokenizer too).
    base = train_hf_tokenizer(["<|pad|>"])
    base_size = base.get_vocab_size()
    config = {
        "bos_token": LLAMA3_BOS,
        "eos_token": LLAMA3_EOS,
        "pad_token": "<|pad|>",
        "added_tokens_decoder": {
            "128000": {"content": LLAMA3_BOS, "special": True},
            "128001": {"content": LLAMA3_EOS, "special": True},
            "128002": {"content": "<|extra|>", "special": True, "normalized": False},
        },
    }
    tokenizer = load_tokenizer(str(write_hf_folder(tmp_path / "hf", base, config)))
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (base_size + 3, base_size, base_size + 1)


def test_hf_vocab_size_covers_ids_past_gaps(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "cat": 9}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    loaded = load_tokenizer(str(write_hf_folder(tmp_path / "hf", tokenizer, None)))
    assert loaded.encode("cat dog") == [9, 0]
    assert loaded.vocab_size == 10


def test_hf_tokenizer_without_config_finds_common_tokens(tmp_path: Path) -> None:
    llama = load_tokenizer(str(write_hf_folder(tmp_path / "llama", train_hf_tokenizer([LLAMA3_EOS, LLAMA3_BOS]), None)))
    assert (llama.bos_id, llama.eos_id) == (1, 0)
    classic = load_tokenizer(
        str(write_hf_folder(tmp_path / "classic", train_hf_tokenizer(["<unk>", "<s>", "</s>"]), {}))
    )
    assert (classic.bos_id, classic.eos_id) == (1, 2)


def test_hf_tokenizer_json_file_path(hf_folder: Path) -> None:
    from_folder = load_tokenizer(str(hf_folder))
    from_file = build_tokenizer(str(hf_folder / "tokenizer.json"), "unused")
    assert isinstance(from_file, HuggingFaceTokenizer)
    assert from_file.fingerprint == from_folder.fingerprint  # the config beside the file is read
    assert from_file.encode("The cat.", bos=True) == from_folder.encode("The cat.", bos=True)


def test_hf_fingerprint_follows_file_contents(hf_folder: Path, tmp_path: Path) -> None:
    fingerprint = load_tokenizer(str(hf_folder)).fingerprint
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((hf_folder / name).read_bytes())
    assert load_tokenizer(str(copy)).fingerprint == fingerprint
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 8}))
    config_changed = load_tokenizer(str(copy)).fingerprint
    assert config_changed != fingerprint
    write_hf_folder(copy, train_hf_tokenizer([LLAMA3_BOS, LLAMA3_EOS]), None)
    assert load_tokenizer(str(copy)).fingerprint not in (fingerprint, config_changed)


def _one_line_error(error_type: type[Exception], path: Path) -> str:
    with pytest.raises(error_type) as raised:
        build_tokenizer(str(path), "unused")
    message = str(raised.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_hf_errors_name_the_path_on_one_line(hf_folder: Path, tmp_path: Path) -> None:
    assert "not found" in _one_line_error(FileNotFoundError, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "has no tokenizer.json" in _one_line_error(FileNotFoundError, tmp_path / "empty")
    (hf_folder / "tokenizer.json").write_text('{"model": ')
    assert "cannot parse" in _one_line_error(ValueError, hf_folder)
    assert "cannot parse" in _one_line_error(ValueError, hf_folder / "tokenizer.json")


def test_hf_config_errors_name_the_file(hf_folder: Path) -> None:
    config_path = hf_folder / "tokenizer_config.json"
    config_path.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json") as raised:
        load_tokenizer(str(hf_folder))
    assert "\n" not in str(raised.value)


def test_hf_unknown_bos_or_eos_names_the_folder(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "hf", train_hf_tokenizer(["<|pad|>", "<s>"]), {"pad_token": "<|pad|>"})
    message = _one_line_error(ValueError, folder)
    assert "EOS" in message and "</s>" in message


def test_a_tokenizer_that_cannot_encode_a_text_is_one_line_before_launch(tmp_path: Path, capsys) -> None:
    """A word-level tokenizer without an unknown token fails on the first word it lacks: one line
    naming the tokenizer, before launch from the corpus's first document (in the ranks, from any);
    it was the library's bare Exception, a traceback in every rank of every attempt."""
    from programs import preflight

    tokenizer = tokenizers.Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "cat": 2}))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = write_hf_folder(tmp_path / "hf", tokenizer, None)
    loaded = load_tokenizer(str(folder))
    assert loaded.encode("cat cat") == [2, 2]
    message = f"tokenizer {folder / 'tokenizer.json'} cannot encode its text: WordLevel error: Missing [UNK] token"
    with pytest.raises(ValueError, match=re.escape(message)):
        loaded.encode("cat dog")
    (tmp_path / "corpus.txt").write_text("cat dog")
    options = ["--model.tokenizer_path", str(folder), "--training.dataset", str(tmp_path / "corpus.txt")]
    assert preflight.main(["--world-size", "1", *options]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: training.dataset: {message}")


@pytest.mark.skipif(
    not ANCHOR_TOKENIZER.is_dir(), reason=f"torchtitan anchor tokenizer not present at {ANCHOR_TOKENIZER}"
)
def test_hf_anchor_folder_matches_torchtitan() -> None:
    # torchtitan 0.2.2's HuggingFaceTokenizer on this folder: the 2002-entry BPE
    # vocabulary plus <|begin_of_text|> and <|end_of_text|> (named in
    # tokenizer_config.json at 128000/128001) registered as ids 2002 and 2003.
    tokenizer = build_tokenizer(str(ANCHOR_TOKENIZER), "unused")
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (2004, 2002, 2003)
    ids = tokenizer.encode("Hello, world! The quick brown fox.\n", bos=True, eos=True)
    assert ids[0] == 2002 and ids[-1] == 2003 and len(ids) > 2
    assert all(0 <= i < tokenizer.vocab_size for i in ids)

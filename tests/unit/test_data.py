"""Tests of trainer.data.loader (the section's loader from its config) and trainer.data.corpus."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import trainer.data.corpus
from config.errors import ConfigError
from config.manager import load_config
from parallelisms.parallel_dims import ParallelDims
from tests.unit.conftest import CharTokenizer
from trainer.data.batch import IGNORE_INDEX
from trainer.data.corpus import default_corpus_texts, local_corpus_texts
from trainer.data.loader import config_dataloader
from trainer.data.tokenizer import Tokenizer
from trainer.validate import Validator, validation_due

ONE_RANK = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)


def write_corpus(root: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return root


def section_loader(argv: list[str], tokenizer: Tokenizer, option: str = "training.dataset", **options):
    """The loader config_dataloader builds for ``option``'s section of ``argv``'s config, on one rank."""
    config = load_config(argv)
    section = getattr(config, option.partition(".")[0])
    return config_dataloader(
        option, section, config.training, tokenizer, ONE_RANK, seed=0, cache_dir=config.job.cache_dir, **options
    )


# --- the loader of a section -------------------------------------------------------


def test_loader_yields_shifted_windows_of_the_corpus(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    corpus = write_corpus(tmp_path, {"c.txt": "abcdefghijklmnopqrstuvwxyz"})
    argv = ["--training.dataset", str(corpus / "c.txt"), "--training.seq_len", "5"]
    argv += ["--training.local_batch_size", "4", "--job.cache_dir", str(tmp_path / "cache")]
    batch = next(iter(section_loader(argv, char_tokenizer)))
    assert batch.inputs.shape == batch.labels.shape == (4, 5) and batch.inputs.dtype == torch.int64
    assert batch.positions is None and batch.sources is None
    stream = [1, *range(97, 123), 2]  # [bos] a..z [eos]: 28 tokens, 4 windows of 6
    windows = sorted(stream[w * 6 : w * 6 + 6] for w in range(4))
    assert sorted(zip(batch.inputs.tolist(), batch.labels.tolist())) == [(w[:-1], w[1:]) for w in windows]


def test_document_masking_restarts_positions_and_ignores_the_label_across_documents(
    tmp_path: Path, char_tokenizer: CharTokenizer
) -> None:
    corpus = write_corpus(tmp_path, {"a.txt": "ab", "b.txt": "cde"})  # [1 a b 2] [1 c d e 2]
    argv = ["--training.dataset", str(corpus), "--training.seq_len", "8", "--training.local_batch_size", "1"]
    argv += ["--job.cache_dir", str(tmp_path / "cache")]
    batch = next(iter(section_loader(argv, char_tokenizer, document_masking=True)))
    assert batch.inputs.tolist() == [[1, 97, 98, 2, 1, 99, 100, 101]]
    assert batch.labels.tolist() == [[97, 98, 2, IGNORE_INDEX, 99, 100, 101, 2]]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]


def test_training_datasets_are_mixed_at_their_weights(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    corpora = write_corpus(tmp_path, {"a.txt": "a" * 400, "b.txt": "b" * 400})
    argv = ["--training.datasets", f"{corpora / 'a.txt'},{corpora / 'b.txt'}", "--training.dataset_weights", "3,1"]
    argv += ["--training.seq_len", "7", "--training.local_batch_size", "8", "--job.cache_dir", str(tmp_path)]
    batch = next(iter(section_loader(argv, char_tokenizer)))
    assert batch.sources.tolist() == [0, 0, 1, 0, 0, 0, 1, 0]  # lags tie at samples 2 and 6: the lower index
    assert [row[1] for row in batch.inputs.tolist()] == [ord("a" if s == 0 else "b") for s in batch.sources]

    tiny = write_corpus(tmp_path, {"tiny.txt": "abc"}) / "tiny.txt"
    argv[1] = f"{corpora / 'a.txt'},{tiny}"
    message = rf"^training.datasets: dataset {tiny}: corpus has 5 tokens, fewer than one window of seq_len \+ 1 = 8$"
    with pytest.raises(ConfigError, match=message):
        section_loader(argv, char_tokenizer)


def test_validation_batches_take_their_own_shape_or_trainings(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    """torchtitan's validation.local_batch_size and seq_len; unset, training's."""
    corpus = write_corpus(tmp_path / "corpus", {"c.txt": "abcdefghijklmnopqrstuvwxyz" * 20})
    common = [
        "--training.seq_len",
        "16",
        "--training.local_batch_size",
        "4",
        "--job.cache_dir",
        str(tmp_path / "cache"),
    ]
    common += ["--training.dataset", str(corpus), "--validation.dataset", str(corpus), "--validation.enable"]

    def shape(option: str, *overrides: str) -> tuple[int, ...]:
        return tuple(next(iter(section_loader([*common, *overrides], char_tokenizer, option))).inputs.shape)

    own = ["--validation.seq_len", "8", "--validation.local_batch_size", "6"]
    assert shape("validation.dataset", *own) == (6, 8)
    assert shape("training.dataset", *own) == shape("validation.dataset") == (4, 16)


@pytest.mark.parametrize(("freq", "steps"), [(4, [1, 4, 8]), (1, list(range(1, 11))), (20, [1])])
def test_validation_follows_step_one_and_every_freq_steps(freq: int, steps: list[int]) -> None:
    """torchtitan's validation.freq: a validation after step 1 and after every freq-th step, so a
    run's first validation loss does not wait freq steps."""
    assert [step for step in range(1, 11) if validation_due(step, freq)] == steps


def validator(argv: list[str], tokenizer: CharTokenizer) -> Validator:
    """The Validator the trainer builds for ``argv``, on one rank."""
    config = load_config(argv)
    return Validator(
        config.validation,
        lambda: config_dataloader(
            "validation.dataset",
            config.validation,
            config.training,
            tokenizer,
            ONE_RANK,
            seed=1,
            cache_dir=config.job.cache_dir,
        ),
        ONE_RANK.dp_degree,
        loss=None,
    )


def test_a_validation_corpus_shorter_than_one_window_is_refused_before_training(
    tmp_path: Path, char_tokenizer: CharTokenizer
) -> None:
    """Found when the validator is built, as the run starts, not at the first validation after
    validation.freq steps of training."""
    corpus = write_corpus(tmp_path, {"held_out.txt": "abc"})
    options = ["--training.seq_len", "8", "--job.cache_dir", str(tmp_path / "cache")]
    options += ["--validation.dataset", str(corpus / "held_out.txt")]
    message = r"^validation.dataset: dataset .*held_out.txt: corpus has 5 tokens, fewer than one window"
    with pytest.raises(ConfigError, match=message):
        validator([*options, "--validation.enable"], char_tokenizer)
    validator(options, char_tokenizer)  # validation off: not read


def test_a_validation_corpus_of_fewer_windows_than_a_validation_reads_is_a_warning(
    tmp_path: Path, char_tokenizer: CharTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """28 tokens are 3 windows of 9; 2 steps of 2 sequences read 4, one of them twice: a warning
    says so."""
    corpus = write_corpus(tmp_path, {"held_out.txt": "abcdefghijklmnopqrstuvwxyz"})
    options = ["--training.seq_len", "8", "--training.local_batch_size", "2", "--job.cache_dir", str(tmp_path)]
    options += ["--validation.enable", "--validation.dataset", str(corpus / "held_out.txt")]
    with caplog.at_level("WARNING"):
        validator([*options, "--validation.steps", "1"], char_tokenizer)
        assert caplog.messages == []
        validator([*options, "--validation.steps", "2"], char_tokenizer)
    assert caplog.messages == [
        "validation.dataset: 3 windows of seq_len + 1 = 9 tokens, fewer than the 4 that validation.steps 2 x 2 "
        "sequences read: each validation reads some windows more than once"
    ]


# --- local corpora ---------------------------------------------------------


def test_jsonl_txt_and_folder_corpora(tmp_path: Path) -> None:
    corpus = write_corpus(
        tmp_path / "corpus",
        {
            "b.txt": "second file",
            "a/z.jsonl": '{"text": "first", "id": 1}\n\n{"text": "line 3"}\n',  # blank line skipped
            "c/d/e.txt": "nested",
            "notes.md": "ignored",
        },
    )
    assert list(local_corpus_texts(str(corpus))) == ["first", "line 3", "second file", "nested"]
    assert list(local_corpus_texts(str(corpus / "b.txt"))) == ["second file"]
    assert list(local_corpus_texts(str(corpus / "a/z.jsonl"))) == ["first", "line 3"]


def test_hidden_files_and_folders_of_a_corpus_folder_are_not_read(tmp_path: Path, caplog) -> None:
    """A notebook's .ipynb_checkpoints copy of a shard trained a second time, without a word."""
    corpus = write_corpus(tmp_path, {"a.jsonl": '{"text": "shard"}\n'})
    write_corpus(corpus / ".ipynb_checkpoints", {"a-checkpoint.jsonl": '{"text": "copy"}\n'})
    write_corpus(corpus, {".draft.txt": "hidden", ".DS_Store": "not a corpus file"})
    with caplog.at_level("WARNING", logger="trainer.data.corpus"):
        assert list(local_corpus_texts(str(corpus))) == ["shard"]
    hidden = f"{corpus / '.draft.txt'}, {corpus / '.ipynb_checkpoints'}"
    assert caplog.messages == [f"{corpus}: hidden files and folders are not read: {hidden}"]


def test_a_byte_order_mark_is_not_text(tmp_path: Path) -> None:
    """Files saved by Windows editors begin with one: a .jsonl was refused ('Unexpected UTF-8 BOM
    (decode using utf-8-sig)') and a .txt trained on it as a character."""
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfplain text")
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a record"}\n')
    assert list(local_corpus_texts(f"{tmp_path / 'a.txt'},{tmp_path / 'b.jsonl'}")) == ["plain text", "a record"]


def test_jsonl_records_may_hold_unicode_line_separators(tmp_path: Path) -> None:
    """Valid JSON Lines, as json.dumps(ensure_ascii=False) writes web text: each record ends at
    '\\n' alone (CRLF too). U+2028, U+2029 and U+0085 inside a string cut the line in two until
    2026-11-29, and the file was refused as invalid JSON."""
    texts = ["one\u2028two", "para\u2029graph", "next\x85line"]
    lines = [json.dumps({"text": text}, ensure_ascii=False) for text in texts]
    path = write_corpus(tmp_path, {"web.jsonl": "\r\n".join(lines) + "\r\n"}) / "web.jsonl"
    assert list(local_corpus_texts(str(path))) == texts


def test_a_corpus_folder_reads_its_symlinked_folders_once_and_no_folder_around_it(tmp_path: Path) -> None:
    """A folder of links to shards kept elsewhere: the linked folders are read, as linked files are."""
    corpus = write_corpus(tmp_path / "corpus", {"own/a.txt": "own"})
    write_corpus(tmp_path / "elsewhere", {"b.txt": "linked folder", "single/c.txt": "linked file"})
    (corpus / "linked").symlink_to(tmp_path / "elsewhere")
    (corpus / "again").symlink_to(corpus / "own")  # read once: again/ comes first
    (corpus / "up").symlink_to(tmp_path)  # a link back up: not the folders around the corpus
    assert list(local_corpus_texts(str(corpus))) == ["own", "linked folder", "linked file"]


def test_a_corpus_subfolder_that_cannot_be_read_is_refused(tmp_path: Path, monkeypatch) -> None:
    """os.walk passed over it: its shards were left out without a word. (Root reads any folder,
    so the refusal to list it is played by scandir.)"""
    corpus = write_corpus(tmp_path, {"a.txt": "read", "locked/b.txt": "unreadable"})
    scandir = os.scandir

    def refuse_locked(path):
        if str(path) == str(corpus / "locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse_locked)
    with pytest.raises(ValueError) as raised:
        list(local_corpus_texts(str(corpus)))
    assert str(raised.value) == f"{corpus / 'locked'}: cannot read this folder of the corpus (Permission denied)"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"content": "no text"}\n', r"bad.jsonl:2: expected .*'text'"),
        ('{"text": "ok"}\n\n{"text": 3}\n', r"bad.jsonl:3: expected .*'text'"),
        ('{"text": "ok"}\n{"text": \n', r"bad.jsonl:2: invalid JSON"),
    ],
)
def test_bad_jsonl_line_is_named(tmp_path: Path, content: str, message: str) -> None:
    path = write_corpus(tmp_path, {"bad.jsonl": content}) / "bad.jsonl"
    with pytest.raises(ValueError, match=message):
        list(local_corpus_texts(str(path)))


def test_corpus_path_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing_corpus"):
        list(local_corpus_texts(str(tmp_path / "missing_corpus")))
    empty = write_corpus(tmp_path / "empty", {"readme.md": "no corpus here"})
    with pytest.raises(ValueError, match="empty contains no .txt, .jsonl, .parquet"):
        list(local_corpus_texts(str(empty)))
    with pytest.raises(ValueError, match="readme.md does not end in one of .txt, .jsonl"):
        list(local_corpus_texts(str(empty / "readme.md")))
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8"):
        list(local_corpus_texts(str(tmp_path / "latin1.txt")))


# --- default corpus --------------------------------------------------------


def test_default_corpus_is_python_documentation() -> None:
    documents = list(default_corpus_texts())
    assert documents == list(default_corpus_texts())
    from pydoc_data.topics import topics

    assert documents[: len(topics)] == [topics[name] for name in sorted(topics)]
    modules = documents[len(topics) :]
    assert len(modules) > 300
    assert any(doc.startswith("JSON (JavaScript Object Notation)") for doc in modules)  # json/__init__.py
    assert 1_000_000 < sum(map(len, documents)) < 20_000_000


def test_a_missing_corpus_is_named_by_its_option(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    argv = ["--training.dataset", str(tmp_path / "missing_corpus"), "--job.cache_dir", str(tmp_path / "cache")]
    with pytest.raises(ConfigError, match=r"^training.dataset: .*missing_corpus"):
        section_loader(argv, char_tokenizer)


def test_python_docs_dataset_with_default_tokenizer(
    tmp_path: Path, session_default_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--job.cache_dir", str(tmp_path)]
    batch = next(iter(section_loader(argv, session_default_tokenizer)))
    assert batch.inputs.shape == (2, 64) and torch.equal(batch.inputs[:, 1:], batch.labels[:, :-1])
    assert int(batch.inputs.max()) < session_default_tokenizer.vocab_size

    def fail() -> None:
        raise AssertionError("the prepared token shards should be used")

    monkeypatch.setattr(trainer.data.corpus, "default_corpus_texts", fail)
    assert torch.equal(next(iter(section_loader(argv, session_default_tokenizer))).inputs, batch.inputs)

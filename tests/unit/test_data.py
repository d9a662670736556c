"""Tests of trainer.data.loader and trainer.data.corpus."""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import trainer.data.corpus
from config.errors import ConfigError
from config.manager import load_config
from parallelisms.parallel_dims import ParallelDims
from tests.unit.conftest import CharTokenizer
from trainer.data.corpus import Corpus, default_corpus_texts, local_corpus_texts
from trainer.data.loader import (
    PackedTokenDataset,
    build_dataset,
    config_dataloader,
    epoch_permutation,
    load_token_stream,
    packed_dataloader,
)
from trainer.data.tokenizer import Tokenizer
from trainer.validate import Validator, validation_due

SEQ_LEN = 3
NUM_WINDOWS = 7
SEED = 1234


def arange_dataset(*, local_batch_size: int, dp_rank: int = 0, dp_world_size: int = 1) -> PackedTokenDataset:
    """Dataset whose window ``w`` holds the tokens ``w * 4 .. w * 4 + 3``."""
    return PackedTokenDataset(
        np.arange(NUM_WINDOWS * (SEQ_LEN + 1) + 2, dtype=np.uint16),  # +2: dropped remainder
        seq_len=SEQ_LEN,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=SEED,
    )


def arange_loader(
    *, local_batch_size: int, dp_rank: int = 0, dp_world_size: int = 1, num_workers: int = 0
) -> StatefulDataLoader:
    dataset = arange_dataset(local_batch_size=local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size)
    return packed_dataloader(dataset, num_workers=num_workers)


def build_dataloader(dataset: str, tokenizer: Tokenizer, **dataset_options) -> StatefulDataLoader:
    return packed_dataloader(build_dataset(Corpus(dataset), tokenizer, **dataset_options))


def global_order(length: int) -> list[int]:
    """The first ``length`` window ids of the global stream, computed directly."""
    order: list[int] = []
    epoch = 0
    while len(order) < length:
        generator = torch.Generator().manual_seed(SEED + epoch)
        order += torch.randperm(NUM_WINDOWS, generator=generator).tolist()
        epoch += 1
    return order[:length]


def take_window_ids(batches, steps: int) -> list[list[int]]:
    """The window ids of the next ``steps`` batches of an ``arange_dataset`` loader."""
    return [(next(batches)[0][:, 0] // (SEQ_LEN + 1)).tolist() for _ in range(steps)]


def write_corpus(root: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return root


# --- packing ---------------------------------------------------------------


def test_packing_matches_hand_computation(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    corpus = write_corpus(tmp_path / "corpus", {"a.txt": "ab", "b.txt": "cde"})
    tokens = load_token_stream(Corpus(str(corpus)), char_tokenizer, str(tmp_path / "cache"))
    # [bos a b eos] [bos c d e eos] concatenated.
    assert tokens.tolist() == [1, 97, 98, 2, 1, 99, 100, 101, 2]
    dataset = PackedTokenDataset(tokens, seq_len=3, local_batch_size=1, dp_rank=0, dp_world_size=1, seed=0)
    assert dataset.num_windows == 2  # 9 tokens -> two windows of 4, the final EOS is dropped
    assert dataset.window(0).tolist() == [1, 97, 98, 2]
    assert dataset.window(1).tolist() == [1, 99, 100, 101]
    samples = [sample for sample, _ in zip(dataset, range(2))]
    first_window = epoch_permutation(2, 0, 0)[0].item()
    inputs, labels = samples[0]
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.tolist() == dataset.window(first_window)[:-1].tolist()
    assert labels.tolist() == dataset.window(first_window)[1:].tolist()


def test_loader_yields_shifted_int64_batches(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    corpus = write_corpus(tmp_path, {"c.txt": "abcdefghijklmnopqrstuvwxyz"})
    loader = build_dataloader(
        str(corpus / "c.txt"),
        char_tokenizer,
        seq_len=5,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        seed=3,
        cache_dir=str(tmp_path / "cache"),
    )
    inputs, labels = next(iter(loader))
    assert inputs.shape == labels.shape == (2, 5) and inputs.dtype == labels.dtype == torch.int64
    stream = [1, *range(97, 123), 2]  # 28 tokens -> 4 windows of 6
    windows = [stream[w * 6 : w * 6 + 6] for w in epoch_permutation(4, 3, 0)[:2].tolist()]
    assert inputs.tolist() == [w[:-1] for w in windows] and labels.tolist() == [w[1:] for w in windows]


def test_validation_batches_take_their_own_shape_or_trainings(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    """torchtitan's validation.local_batch_size and seq_len; unset, training's."""
    corpus = write_corpus(tmp_path, {"c.txt": "abcdefghijklmnopqrstuvwxyz" * 20})
    common = ["--training.seq_len", "16", "--training.local_batch_size", "4", "--job.cache_dir", str(tmp_path)]
    common += ["--training.dataset", str(corpus), "--validation.dataset", str(corpus), "--validation.enable"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)

    def shape(option: str, *overrides: str) -> tuple[int, ...]:
        config = load_config([*common, *overrides])
        section = getattr(config, option.partition(".")[0])
        loader = config_dataloader(
            option, section, config.training, char_tokenizer, dims, seed=0, cache_dir=config.job.cache_dir
        )
        return tuple(next(iter(loader))[0].shape)

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
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    return Validator(
        config.validation,
        lambda: config_dataloader(
            "validation.dataset",
            config.validation,
            config.training,
            tokenizer,
            dims,
            seed=1,
            cache_dir=config.job.cache_dir,
        ),
        dims.dp_degree,
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


def test_corpus_smaller_than_one_window(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    corpus = write_corpus(tmp_path, {"tiny.txt": "abc"})
    with pytest.raises(ValueError, match=r"tiny.txt.*5 tokens.*seq_len \+ 1 = 9"):
        build_dataloader(
            str(corpus / "tiny.txt"),
            char_tokenizer,
            seq_len=8,
            local_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
            seed=0,
            cache_dir=str(tmp_path / "cache"),
        )


# --- global order ----------------------------------------------------------


def test_epoch_permutation_is_seeded_and_differs_across_epochs() -> None:
    first = epoch_permutation(50, SEED, 0)
    assert sorted(first.tolist()) == list(range(50))
    assert first.tolist() == epoch_permutation(50, SEED, 0).tolist()
    assert first.tolist() != epoch_permutation(50, SEED, 1).tolist()
    # Epoch e of seed s is the permutation drawn with seed s + e.
    assert epoch_permutation(50, SEED, 1).tolist() == epoch_permutation(50, SEED + 1, 0).tolist()
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(SEED + 3))
    assert epoch_permutation(50, SEED, 3).tolist() == expected.tolist()


def test_loader_follows_global_order_across_epochs() -> None:
    batches = iter(arange_loader(local_batch_size=3))
    ids = sum(take_window_ids(batches, 5), [])  # 15 samples span three epochs of 7
    assert ids == global_order(15)
    # Every sample is a whole window w: tokens 4 * w .. 4 * w + 3, shifted by one for the labels.
    inputs, labels = next(batches)
    window_ids = inputs[:, 0] // 4
    assert inputs.tolist() == [[4 * w + i for i in range(SEQ_LEN)] for w in window_ids.tolist()]
    assert labels.tolist() == [[4 * w + 1 + i for i in range(SEQ_LEN)] for w in window_ids.tolist()]


def test_dp_ranks_concatenated_equal_single_rank_with_double_batch() -> None:
    single = iter(arange_loader(local_batch_size=4))
    ranks = [iter(arange_loader(local_batch_size=2, dp_rank=r, dp_world_size=2)) for r in range(2)]
    for _ in range(6):
        expected = next(single)
        per_rank = [next(rank) for rank in ranks]
        for field in range(2):
            assert torch.equal(torch.cat([batch[field] for batch in per_rank]), expected[field])


# --- resume ----------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("steps_before_save", [1, 3])  # 3 * 3 samples crosses an epoch of 7
def test_resume_yields_the_uninterrupted_batches(num_workers: int, steps_before_save: int) -> None:
    loader = arange_loader(local_batch_size=3, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    batches = iter(loader)
    before = take_window_ids(batches, steps_before_save)
    state = copy.deepcopy(loader.state_dict())
    uninterrupted = take_window_ids(batches, 4)

    resumed_loader = arange_loader(local_batch_size=3, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    resumed_loader.load_state_dict(state)
    assert take_window_ids(iter(resumed_loader), 4) == uninterrupted

    # Rank 1 reads samples 3..5 of every chunk of 6 in the global order.
    order = global_order(6 * (steps_before_save + 4))
    expected = [order[6 * step + 3 : 6 * step + 6] for step in range(steps_before_save + 4)]
    assert before + uninterrupted == expected


def test_resume_with_different_dp_world_size_continues_global_order() -> None:
    # 3 steps at dp=1 x 4, then 4 steps at dp=2 x 2, then 3 steps at dp=1 x 4:
    # 40 samples = 40 positions of the global stream, none lost or repeated.
    single = arange_loader(local_batch_size=4)
    batches = iter(single)
    consumed = sum(take_window_ids(batches, 3), [])

    ranks = [arange_loader(local_batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(copy.deepcopy(single.state_dict()))
    rank_batches = [iter(rank) for rank in ranks]
    for _ in range(4):
        for batch in rank_batches:
            consumed += take_window_ids(batch, 1)[0]

    resumed_single = arange_loader(local_batch_size=4)
    resumed_single.load_state_dict(copy.deepcopy(ranks[1].state_dict()))
    consumed += sum(take_window_ids(iter(resumed_single), 3), [])

    assert consumed == global_order(40)
    counts = Counter(consumed[:35])  # exactly five epochs of 7 windows
    assert counts == {window: 5 for window in range(NUM_WINDOWS)}


def test_state_mismatch_is_rejected() -> None:
    dataset = arange_dataset(local_batch_size=2)
    state = dataset.state_dict()
    with pytest.raises(ValueError, match="seed"):
        arange_dataset(local_batch_size=2).load_state_dict({**state, "seed": SEED + 1})
    # Batches of 2 into batches of 4 (gradient accumulation at one layout, none at another): at
    # sample 2 no batch of 4 begins; at sample 4 one does.
    with pytest.raises(ValueError, match="at sample 2 of batches of 2, where no batch of this loader's 4"):
        arange_dataset(local_batch_size=4).load_state_dict({**state, "chunk_start": 2})
    arange_dataset(local_batch_size=4).load_state_dict({**state, "chunk_start": 4})
    with pytest.raises(ValueError, match="lacks chunk_start"):
        state_without_position = {k: v for k, v in state.items() if k != "chunk_start"}
        arange_dataset(local_batch_size=2).load_state_dict(state_without_position)
    with pytest.raises(ValueError, match="inside a batch"):
        arange_dataset(local_batch_size=1, dp_world_size=2).load_state_dict({**state, "index_in_slice": 1})


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


def test_corpus_path_errors(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    with pytest.raises(FileNotFoundError, match="missing_corpus"):
        list(local_corpus_texts(str(tmp_path / "missing_corpus")))
    with pytest.raises(FileNotFoundError, match="missing_corpus"):
        build_dataloader(
            str(tmp_path / "missing_corpus"),
            char_tokenizer,
            seq_len=4,
            local_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
            seed=0,
            cache_dir=str(tmp_path / "cache"),
        )
    empty = write_corpus(tmp_path / "empty", {"readme.md": "no corpus here"})
    with pytest.raises(ValueError, match="empty contains no .txt, .jsonl, .parquet"):
        list(local_corpus_texts(str(empty)))
    with pytest.raises(ValueError, match="readme.md does not end in one of .txt, .jsonl"):
        list(local_corpus_texts(str(empty / "readme.md")))
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8"):
        list(local_corpus_texts(str(tmp_path / "latin1.txt")))


# --- token stream cache ----------------------------------------------------


def test_token_stream_is_cached_and_invalidated_by_changes(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    corpus = write_corpus(tmp_path / "corpus", {"a.txt": "abc"})
    cache_dir = str(tmp_path / "cache")
    assert load_token_stream(Corpus(str(corpus)), char_tokenizer, cache_dir).tolist() == [1, 97, 98, 99, 2]
    assert load_token_stream(Corpus(str(corpus)), char_tokenizer, cache_dir).tolist() == [1, 97, 98, 99, 2]
    assert char_tokenizer.encode_calls == 1
    (corpus / "a.txt").write_text("abcd")
    assert load_token_stream(Corpus(str(corpus)), char_tokenizer, cache_dir).tolist() == [1, 97, 98, 99, 100, 2]
    assert char_tokenizer.encode_calls == 2
    assert not [name for name in os.listdir(cache_dir) if name.endswith(".tmp")]


def test_a_damaged_token_cache_is_named(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    corpus = Corpus(str(write_corpus(tmp_path / "corpus", {"a.txt": "abc" * 100})))
    cache_dir = tmp_path / "cache"
    load_token_stream(corpus, char_tokenizer, str(cache_dir))
    (cached,) = cache_dir.glob("tokens-*.npy")
    cached.write_bytes(cached.read_bytes()[:200])  # cut short
    with pytest.raises(
        ValueError, match=f"^its token cache {cached} is damaged .*; delete the file and it is rebuilt$"
    ):
        load_token_stream(corpus, char_tokenizer, str(cache_dir))
    cached.unlink()
    assert len(load_token_stream(corpus, char_tokenizer, str(cache_dir))) == 302


def test_a_token_cache_with_ids_outside_the_vocabulary_is_named(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    """Trained on, such ids failed every attempt's first step with an IndexError."""
    corpus = Corpus(str(write_corpus(tmp_path / "corpus", {"a.txt": "abc" * 100})))
    cache_dir = tmp_path / "cache"
    load_token_stream(corpus, char_tokenizer, str(cache_dir))
    (cached,) = cache_dir.glob("tokens-*.npy")
    with open(cached, "wb") as f:
        np.save(f, np.full(302, 128, dtype=np.uint16))
    problem = "it holds id 128, past the tokenizer's 128 ids"
    with pytest.raises(ValueError) as error:
        load_token_stream(corpus, char_tokenizer, str(cache_dir))
    assert str(error.value) == f"its token cache {cached} is damaged ({problem}); delete the file and it is rebuilt"
    cached.unlink()
    assert load_token_stream(corpus, char_tokenizer, str(cache_dir)).max() == ord("c")


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


def test_python_docs_dataset_with_default_tokenizer(
    tmp_path: Path, session_default_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = dict(seq_len=64, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0, cache_dir=str(tmp_path))
    inputs, labels = next(iter(build_dataloader("python_docs", session_default_tokenizer, **options)))
    assert inputs.shape == (2, 64) and torch.equal(inputs[:, 1:], labels[:, :-1])
    assert int(inputs.max()) < session_default_tokenizer.vocab_size

    def fail() -> None:
        raise AssertionError("the cached token stream should be used")

    monkeypatch.setattr(trainer.data.corpus, "default_corpus_texts", fail)
    cached_inputs, _ = next(iter(build_dataloader("python_docs", session_default_tokenizer, **options)))
    assert torch.equal(cached_inputs, inputs)

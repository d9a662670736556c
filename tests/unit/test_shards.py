"""Token shards (trainer/data/shards.py): the stream equals every document framed as [bos] + ids + [eos]
and concatenated in corpus order, whatever the number of preparing processes; interrupted and
concurrent preparation; damaged folders; the largest-id check; bounded memory; batch encoding."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import tracemalloc
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trainer.data.corpus as corpus_module
import trainer.data.shards as shards_module
from programs import prepare_data
from tests.unit.conftest import CharTokenizer
from tests.unit.test_tokenizer import LLAMA3_BOS, LLAMA3_EOS, TINY_MERGES, train_hf_tokenizer, write_tiktoken_file
from trainer.data.corpus import Corpus, default_corpus_texts
from trainer.data.shards import ShardedTokens, TextEncoder, prepare_tokens, token_folder
from trainer.data.tokenizer import HuggingFaceTokenizer, TiktokenTokenizer, Tokenizer

REPO = Path(__file__).resolve().parents[2]


def framed(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """Today's token stream: each document as [bos] + ids + [eos], concatenated in order."""
    ids = [[tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id] for text in texts]
    return np.array([i for document in ids for i in document], dtype=np.int64)


def document_starts(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    lengths = [len(tokenizer.encode(text)) + 2 for text in texts]
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def jsonl_corpus(path: Path, count: int = 400) -> list[str]:
    texts = [f"document {i}: " + "words and more words " * (i % 13) for i in range(count)]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return texts


def shard_files(folder: str) -> dict[str, bytes]:
    return {name: Path(folder, name).read_bytes() for name in sorted(os.listdir(folder)) if name.startswith("shard")}


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 4 KiB: a small corpus makes several shards (pieces are cut in the calling process)."""
    monkeypatch.setattr(corpus_module, "PIECE_BYTES", 4096)


def test_jsonl_shards_equal_the_framed_documents(tmp_path: Path, char_tokenizer: CharTokenizer, small_pieces) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl")
    tokens = prepare_tokens(Corpus(str(tmp_path / "a.jsonl")), TextEncoder(char_tokenizer), str(tmp_path), workers=1)
    assert len(tokens._shards) > 5
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), framed(char_tokenizer, texts))
    assert np.array_equal(tokens.document_starts(0, tokens.num_tokens), document_starts(char_tokenizer, texts))
    assert (tokens.num_documents, tokens.has_loss_mask, tokens.loss_mask(0, 5)) == (len(texts), False, None)


def test_a_txt_folder_is_one_document_per_file_in_sorted_order(
    tmp_path: Path, char_tokenizer: CharTokenizer, small_pieces
) -> None:
    texts = {f"part-{i:02d}.txt": f"file {i} " * (50 * i + 1) for i in range(12)}
    folder = tmp_path / "texts"
    (folder / "deeper").mkdir(parents=True)
    for name, text in reversed(texts.items()):
        (folder / name).write_text(text)
    (folder / "deeper" / "z.txt").write_text("nested")
    tokens = prepare_tokens(Corpus(str(folder)), TextEncoder(char_tokenizer), str(tmp_path / "cache"), workers=1)
    assert len(tokens._shards) > 2
    expected = ["nested", *texts.values()]  # "deeper/" sorts before "part-00.txt"
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), framed(char_tokenizer, expected))


def test_parquet_shards_are_one_shard_each(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    folder = tmp_path / "parquet"
    folder.mkdir()
    parts = [[f"row {i} of part {p}" for i in range(30)] for p in range(3)]
    for p, texts in enumerate(parts):
        pq.write_table(pa.table({"body": texts}), folder / f"part-{p}.parquet")
    corpus = Corpus(str(folder), text_field="body")
    tokens = prepare_tokens(corpus, TextEncoder(char_tokenizer, "body"), str(tmp_path / "cache"), workers=1)
    assert [shard["documents"] for shard in tokens._shards] == [30, 30, 30]
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), framed(char_tokenizer, sum(parts, [])))


def test_the_default_corpus_is_one_shard(tmp_path: Path, session_default_tokenizer: Tokenizer) -> None:
    tokens = prepare_tokens(Corpus("python_docs"), TextEncoder(session_default_tokenizer), str(tmp_path), workers=1)
    expected = framed(session_default_tokenizer, list(default_corpus_texts()))
    assert len(tokens._shards) == 1
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), expected)


def test_one_and_two_workers_write_the_same_shards(
    tmp_path: Path, session_default_tokenizer: Tokenizer, small_pieces
) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl")
    corpus, encoder = Corpus(str(tmp_path / "a.jsonl")), TextEncoder(session_default_tokenizer)
    one = prepare_tokens(corpus, encoder, str(tmp_path / "one"), workers=1)
    two = prepare_tokens(corpus, encoder, str(tmp_path / "two"), workers=2)
    assert shard_files(one.folder) == shard_files(two.folder)
    assert np.array_equal(two.tokens(0, two.num_tokens), framed(session_default_tokenizer, texts))


def test_a_small_corpus_is_cut_finer_at_newlines(tmp_path: Path) -> None:
    """Under 64 pieces of PIECE_BYTES, pieces shrink to MIN_PIECE_BYTES: both processes get work."""
    jsonl_corpus(tmp_path / "a.jsonl", count=30_000)
    data = (tmp_path / "a.jsonl").read_bytes()
    pieces = corpus_module.corpus_pieces(Corpus(str(tmp_path / "a.jsonl")))
    assert len(pieces) == len(data) // corpus_module.MIN_PIECE_BYTES + 1
    assert [(p.start, p.stop) for p in pieces] == list(
        zip([0] + [p.stop for p in pieces[:-1]], [p.stop for p in pieces])
    )
    assert pieces[-1].stop == len(data) and all(data[p.start - 1] == ord("\n") for p in pieces[1:])


def test_windows_across_shards(tmp_path: Path, char_tokenizer: CharTokenizer, small_pieces) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl")
    tokens = prepare_tokens(Corpus(str(tmp_path / "a.jsonl")), TextEncoder(char_tokenizer), str(tmp_path), workers=1)
    stream, starts = framed(char_tokenizer, texts), document_starts(char_tokenizer, texts)
    boundary = int(tokens._starts[2])
    for start, stop in [(boundary - 7, boundary + 9), (0, 0), (5, 6), (tokens.num_tokens - 3, tokens.num_tokens)]:
        assert np.array_equal(tokens.tokens(start, stop), stream[start:stop])
        assert np.array_equal(tokens.document_starts(start, stop), starts[(starts >= start) & (starts < stop)])
    with pytest.raises(IndexError):
        tokens.tokens(0, tokens.num_tokens + 1)


def test_an_interrupted_preparation_keeps_its_complete_shards(
    tmp_path: Path, char_tokenizer: CharTokenizer, small_pieces
) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl")
    corpus, encoder = Corpus(str(tmp_path / "a.jsonl")), TextEncoder(char_tokenizer)
    folder = prepare_tokens(corpus, encoder, str(tmp_path / "cache"), workers=1).folder
    # As a preparation stopped mid-way leaves it: no index, shard 3 half-written under its temporary name.
    os.remove(Path(folder, "index.json"))
    for suffix in ("json", "tokens", "docs"):
        os.remove(Path(folder, f"shard-00003.{suffix}"))
    Path(folder, "shard-00003.tokens.999.tmp").write_bytes(b"\0" * 10)
    kept = {name: os.stat(Path(folder, name)) for name in os.listdir(folder) if name.startswith("shard-00001")}
    tokens = prepare_tokens(corpus, encoder, str(tmp_path / "cache"), workers=2)
    for name, stat in kept.items():
        now = os.stat(Path(folder, name))
        assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns), name
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), framed(char_tokenizer, texts))


class DyingEncoder(TextEncoder):
    """A worker process that meets document 300 dies, as one killed or out of memory does."""

    def encode_batch(self, values: list[Any], where: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        if any(value.startswith("document 300:") for value in values):
            os._exit(9)
        return super().encode_batch(values, where)


def test_a_preparation_whose_worker_dies_fails_and_resumes(
    tmp_path: Path, char_tokenizer: CharTokenizer, small_pieces
) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl")
    corpus = Corpus(str(tmp_path / "a.jsonl"))
    with pytest.raises(BrokenProcessPool):
        prepare_tokens(corpus, DyingEncoder(char_tokenizer), str(tmp_path), workers=2)
    folder = token_folder(corpus, TextEncoder(char_tokenizer), str(tmp_path))
    kept = {name: os.stat(Path(folder, name)).st_ino for name in os.listdir(folder) if name.endswith(".tokens")}
    assert kept and not Path(folder, "index.json").exists()
    tokens = prepare_tokens(corpus, TextEncoder(char_tokenizer), str(tmp_path), workers=2)
    assert all(os.stat(Path(folder, name)).st_ino == inode for name, inode in kept.items())
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), framed(char_tokenizer, texts))


PREPARE = """
import sys
from tests.unit.conftest import CharTokenizer
import trainer.data.corpus as corpus_module
from programs import prepare_data
from trainer.data.corpus import Corpus
from trainer.data.shards import TextEncoder, prepare_tokens
corpus_module.PIECE_BYTES = 4096
tokens = prepare_tokens(Corpus(sys.argv[1]), TextEncoder(CharTokenizer()), sys.argv[2], workers=1)
print(tokens.num_tokens)
"""


def start_preparer(corpus: Path, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PREPARE, str(corpus), str(cache)], cwd=REPO, stdout=subprocess.PIPE)


def test_a_shard_another_process_holds_is_skipped_then_waited_for(
    tmp_path: Path, char_tokenizer: CharTokenizer, small_pieces
) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl")
    corpus, encoder = Corpus(str(tmp_path / "a.jsonl")), TextEncoder(char_tokenizer)
    folder = token_folder(corpus, encoder, str(tmp_path / "cache"))
    os.makedirs(folder)
    with shards_module._locked(shards_module._shard_path(folder, 2, "lock")):  # this process claims shard 2
        preparer = start_preparer(tmp_path / "a.jsonl", tmp_path / "cache")
        deadline = time.monotonic() + 30
        while not all(shards_module._complete(folder, i) for i in (0, 1, 3, 4)):
            assert preparer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        assert preparer.poll() is None and not shards_module._complete(folder, 2)  # it waits for shard 2
        shards_module._build_claimed_piece((folder, 2, corpus_module.corpus_pieces(corpus)[2], True), encoder)
    output, _ = preparer.communicate(timeout=30)
    assert int(output) == len(framed(char_tokenizer, texts))
    assert np.array_equal(ShardedTokens(folder).tokens(0, int(output)), framed(char_tokenizer, texts))


def test_concurrent_preparers_agree(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl", count=1500)
    preparers = [start_preparer(tmp_path / "a.jsonl", tmp_path / "cache") for _ in range(2)]
    outputs = [int(p.communicate(timeout=60)[0]) for p in preparers]
    assert outputs == [len(framed(char_tokenizer, texts))] * 2


def test_a_damaged_folder_is_one_line(tmp_path: Path, char_tokenizer: CharTokenizer, small_pieces) -> None:
    jsonl_corpus(tmp_path / "a.jsonl")
    corpus, encoder = Corpus(str(tmp_path / "a.jsonl")), TextEncoder(char_tokenizer)
    folder = prepare_tokens(corpus, encoder, str(tmp_path), workers=1).folder
    tokens_file = Path(folder, "shard-00001.tokens")
    whole = tokens_file.read_bytes()
    tokens_file.write_bytes(whole[:-2])
    with pytest.raises(ValueError) as raised:
        prepare_tokens(corpus, encoder, str(tmp_path), workers=1)
    message = str(raised.value)
    assert "\n" not in message and message.endswith("delete it and it is rebuilt")
    assert message.startswith(f"token shard folder {folder} is incomplete or damaged (shard-00001.tokens holds")
    tokens_file.write_bytes(whole)
    os.remove(Path(folder, "shard-00002.docs"))
    with pytest.raises(ValueError, match=r"\(shard-00002.docs is missing\)"):
        ShardedTokens(folder)


def test_an_id_past_the_vocabulary_is_refused_when_written(tmp_path: Path, char_tokenizer: CharTokenizer) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "plain"}) + "\n" + json.dumps({"text": "caf\u00e9"}, ensure_ascii=False) + "\n")
    with pytest.raises(ValueError) as raised:
        prepare_tokens(Corpus(str(path)), TextEncoder(char_tokenizer), str(tmp_path / "cache"), workers=1)
    assert str(raised.value) == f"{path}:2: encoded to id 233, past the 128 ids"


def test_a_piece_is_read_and_encoded_in_batches(
    tmp_path: Path, char_tokenizer: CharTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One piece of 4 MB: what preparation holds at once is a batch, far below the corpus."""
    monkeypatch.setattr(corpus_module, "BATCH_BYTES", 2**14)
    monkeypatch.setattr(corpus_module, "MIN_PIECE_BYTES", 2**30)
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} " + "x" * 190}) + "\n" for i in range(20_000)))
    assert len(corpus_module.corpus_pieces(Corpus(str(path)))) == 1
    tracemalloc.start()
    try:
        tokens = prepare_tokens(Corpus(str(path)), TextEncoder(char_tokenizer), str(tmp_path / "cache"), workers=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tokens.num_documents == 20_000
    assert peak < path.stat().st_size / 8, peak


class MaskingEncoder:
    """Odd documents masked after their first token: masks from some documents and not others."""

    fingerprint, field, vocab_size = "masking", "text", 128

    def encode_batch(self, values: list[Any], where: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        out = []
        for value in values:
            ids = np.array([ord(c) for c in value], np.int64)
            number = int(value.split()[1].rstrip(":"))
            out.append((ids, None if number % 2 == 0 else (np.arange(len(ids)) == 0).astype(np.uint8)))
        return out


def test_loss_masks_are_stored_where_the_encoder_gives_them(tmp_path: Path, small_pieces) -> None:
    texts = jsonl_corpus(tmp_path / "a.jsonl", count=60)
    tokens = prepare_tokens(Corpus(str(tmp_path / "a.jsonl")), MaskingEncoder(), str(tmp_path), workers=2)
    expected = np.concatenate(
        [np.ones(len(t), bool) if i % 2 == 0 else np.arange(len(t)) == 0 for i, t in enumerate(texts)]
    )
    assert tokens.has_loss_mask and len(tokens._shards) > 1
    assert np.array_equal(tokens.loss_mask(0, tokens.num_tokens), expected)
    assert np.array_equal(tokens.loss_mask(3, 400), expected[3:400])


def test_a_hub_dataset_is_streamed_into_shards_and_resumed(
    tmp_path: Path, char_tokenizer: CharTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    import huggingface_hub

    records = [{"content": f"record {i}"} for i in range(50)]
    reads: list[int] = []

    def load_dataset(path, **options):
        reads.append(0)
        for record in records:
            reads[-1] += 1
            yield record

    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "dataset_info",
        lambda self, name, timeout=None: huggingface_hub.hf_api.DatasetInfo(id=name, sha="c1"),
    )
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(corpus_module, "BATCH_RECORDS", 4)
    monkeypatch.setattr(shards_module, "BATCH_RECORDS", 4)
    monkeypatch.setattr(shards_module, "HUB_SHARD_DOCUMENTS", 12)
    corpus, encoder = Corpus("org/data", text_field="content"), TextEncoder(char_tokenizer, "content")
    tokens = prepare_tokens(corpus, encoder, str(tmp_path), workers=1)
    assert [shard["documents"] for shard in tokens._shards] == [12, 12, 12, 12, 2]
    expected = framed(char_tokenizer, [r["content"] for r in records])
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), expected)
    os.remove(Path(tokens.folder, "index.json"))
    os.remove(Path(tokens.folder, "shard-00004.json"))
    tokens = prepare_tokens(corpus, encoder, str(tmp_path), workers=2)
    assert np.array_equal(tokens.tokens(0, tokens.num_tokens), expected)


def test_batch_encoding_equals_one_by_one_in_every_library(
    tmp_path: Path, session_default_tokenizer: Tokenizer
) -> None:
    single_bytes = [bytes([b]) for b in range(256)]
    tiktoken_file = write_tiktoken_file(tmp_path / "tokenizer.model", single_bytes + TINY_MERGES)
    hf = tmp_path / "hf"
    hf.mkdir()
    train_hf_tokenizer([LLAMA3_BOS, LLAMA3_EOS]).save(str(hf / "tokenizer.json"))
    texts = ["The quick brown fox", "", "def f(x):\n    return x  # caf\u00e9", f"{LLAMA3_BOS} is text here"]
    for tokenizer in (session_default_tokenizer, TiktokenTokenizer(str(tiktoken_file)), HuggingFaceTokenizer(str(hf))):
        assert tokenizer.encode_batch(texts) == [tokenizer.encode(text) for text in texts]
        copy = pickle.loads(pickle.dumps(tokenizer))  # workers receive it pickled
        assert copy.encode_batch(texts) == tokenizer.encode_batch(texts)


def test_worker_processes_encode_with_one_thread_each(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os
        from trainer.data.shards import _start_worker
        from trainer.data.tokenizer import encode_threads
        _start_worker(None)
        print(encode_threads(), os.environ["TOKENIZERS_PARALLELISM"])
        """
    )
    output = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert output.stdout.split() == ["1", "false"]


def test_prepare_data_prints_each_corpus_and_names_bad_input_in_one_line(
    tmp_path: Path, default_tokenizer_cache: str, capsys: pytest.CaptureFixture
) -> None:
    jsonl_corpus(tmp_path / "a.jsonl")
    options = ["--job.cache_dir", default_tokenizer_cache, "--training.dataset_prepare_workers", "1"]
    argv = ["--training.dataset", str(tmp_path / "a.jsonl"), "--validation.enable", *options]
    assert prepare_data.main(argv) == 0
    made = capsys.readouterr().out.splitlines()
    assert made[0].startswith(f"training.dataset {tmp_path / 'a.jsonl'}: {default_tokenizer_cache}/tokens-")
    assert "400 documents" in made[0] and "MB/s" in made[0]
    assert made[1].startswith("validation.dataset python_docs: ")
    assert prepare_data.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("(prepared before)")
    assert prepare_data.main(["--training.dataset", str(tmp_path / "missing.jsonl"), *options]) == 2
    assert capsys.readouterr().err == f"error: training.dataset: dataset path not found: {tmp_path / 'missing.jsonl'}\n"

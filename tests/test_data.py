"""Data: stdlib corpus, sources, packed windows, splits, .bin files, distributed sampling."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_yafsdp.config import DataConfig
from lightning_yafsdp.data import (
    ByteTokenizer,
    PackedSequences,
    TokenDataModule,
    prepare_bin,
    read_bin,
    read_documents,
    split_tokens,
    stdlib_files,
    unigram_entropy,
)


def test_stdlib_files_are_deterministic_and_skip_tests() -> None:
    first, second = stdlib_files(seed=0), stdlib_files(seed=0)
    assert first == second and len(first) > 100
    assert all(path.suffix == ".py" for path in first)
    assert not any("site-packages" in path.parts or "test" in path.parts for path in first)
    assert stdlib_files(seed=1) != first  # the seed changes the order only
    assert sorted(stdlib_files(seed=1)) == sorted(first)


def test_documents_stop_at_the_byte_cap() -> None:
    docs = read_documents("stdlib", max_bytes=100_000)
    assert sum(len(d.encode("utf-8")) for d in docs) <= 100_000
    assert sum(len(d.encode("utf-8")) for d in docs) > 90_000


def test_text_and_jsonl_sources(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.md").write_text("beta")
    assert read_documents("text", path=str(tmp_path), max_bytes=100) == ["alpha", "beta"]
    lines = [json.dumps({"body": "one"}), "", json.dumps({"body": "two"})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    docs = read_documents(
        "jsonl", path=str(tmp_path / "d.jsonl"), max_bytes=100, jsonl_field="body"
    )
    assert docs == ["one", "two"]
    with pytest.raises(ValueError, match="no key 'text'"):
        read_documents("jsonl", path=str(tmp_path / "d.jsonl"), max_bytes=100)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        read_documents("text", path=str(tmp_path / "missing*.txt"), max_bytes=100)


def test_byte_tokenizer_round_trips_utf8() -> None:
    tokens = ByteTokenizer().encode_documents(["héllo", "wörld"])
    assert tokens.max() < 256
    assert ByteTokenizer().decode(tokens.tolist()) == "héllo\n\nwörld"


def test_packed_windows_overlap_by_one_token() -> None:
    data = PackedSequences(np.arange(10, dtype=np.uint16), seq_len=3)
    assert len(data) == 3
    assert data[0].tolist() == [0, 1, 2, 3] and data[1].tolist() == [3, 4, 5, 6]
    assert data[0].dtype == torch.int64
    with pytest.raises(IndexError):
        data[3]


def test_split_keeps_the_tail_for_validation() -> None:
    train, val = split_tokens(np.arange(100), 0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))


def test_unigram_entropy_in_nats() -> None:
    assert unigram_entropy(np.array([0, 1, 2, 3]), 256) == pytest.approx(math.log(4))
    assert unigram_entropy(np.array([7, 7, 7]), 256) == pytest.approx(0.0)


def test_bin_round_trip_with_sidecar(tmp_path) -> None:
    (tmp_path / "t.txt").write_text("abcabc")
    meta = prepare_bin(tmp_path / "t.bin", source="text", path=str(tmp_path / "t.txt"))
    assert meta == {
        "dtype": "uint16",
        "vocab_size": 256,
        "num_tokens": 6,
        "tokenizer": "byte",
        "source": f"text:{tmp_path / 't.txt'}",
    }
    tokens, read_meta = read_bin(tmp_path / "t.bin")
    assert bytes(tokens.astype(np.uint8).tolist()) == b"abcabc"
    assert read_meta["vocab_size"] == 256


def test_uint32_bin_without_sidecar_needs_a_dtype(tmp_path) -> None:
    np.arange(70_000, dtype="<u4").tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="sidecar"):
        read_bin(tmp_path / "big.bin")
    tokens, _ = read_bin(tmp_path / "big.bin", dtype="uint32")
    assert int(tokens[-1]) == 69_999


def test_datamodule_from_bin_and_distributed_sampling(tmp_path) -> None:
    prepare_bin(tmp_path / "s.bin", source="stdlib", max_bytes=50_000)
    module = TokenDataModule(
        DataConfig(source="bin", path=str(tmp_path / "s.bin"), seq_len=32, batch_size=4)
    )
    module.setup("fit")
    assert module.vocab_size == 256 and 0 < module.unigram_entropy < math.log(256)
    dataset = module.train_dataset
    rank_views = [
        list(DistributedSampler(dataset, num_replicas=2, rank=r, seed=3, drop_last=True))
        for r in range(2)
    ]
    assert not set(rank_views[0]) & set(rank_views[1])  # each rank its own slice
    assert len(rank_views[0]) == len(rank_views[1]) == len(dataset) // 2
    batch = next(iter(module.train_dataloader()))
    assert batch.shape == (4, 33)


def test_default_data_is_the_stdlib_in_bytes() -> None:
    module = TokenDataModule(DataConfig(max_bytes=200_000))
    module.setup("fit")
    assert module.train_tokens + module.val_tokens == pytest.approx(200_000, rel=0.01)
    assert 2.0 < module.unigram_entropy < 4.5  # source code: far from uniform (5.55)

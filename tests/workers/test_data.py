"""Pure tests of workers.data: the global sample order survives DP changes with no repeats or skips."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from workers.config import DataConfig
from workers.data import (
    Batch,
    CorpusSource,
    DataLoader,
    DataPosition,
    SyntheticSource,
    TokenFileSource,
    build_source,
    global_sample_ids,
)

SEQ = 8


def _source(n: int = 20, seed: int = 0) -> SyntheticSource:
    return SyntheticSource(num_samples=n, seq_len=SEQ, vocab_size=50, seed=seed)


def _loaders(source, dp: int, *, gbs: int = 8, mbs: int = 1, seed: int = 0, position=None):
    return [DataLoader(source, seed=seed, global_batch_size=gbs, micro_batch_size=mbs, dp_rank=r,
                       dp_size=dp, position=position) for r in range(dp)]


def _run(loaders, steps: int) -> list[int]:
    """Ids consumed by the whole job, global batch after global batch, ranks in order."""
    ids: list[int] = []
    for _ in range(steps):
        for ld in loaders:
            ids += ld.next_batch().sample_ids
    return ids


# -- the global order ------------------------------------------------------------------------------

def test_same_seed_same_order_and_other_seed_differs():
    a = global_sample_ids(0, 100, n_samples=100, seed=1)
    assert np.array_equal(a, global_sample_ids(0, 100, n_samples=100, seed=1))
    assert not np.array_equal(a, global_sample_ids(0, 100, n_samples=100, seed=2))
    assert not np.array_equal(a, np.arange(100))  # shuffled, not the identity


def test_order_matches_documented_formula():
    n, seed = 7, 3
    got = global_sample_ids(0, 3 * n, n_samples=n, seed=seed)
    want = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(3)])
    assert np.array_equal(got, want)


def test_epoch_straddling_sees_every_id_once_per_epoch():
    n = 10
    full = global_sample_ids(0, 3 * n, n_samples=n, seed=5)
    for e in range(3):
        assert sorted(full[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(full[:n], full[n:2 * n])  # each epoch has its own order
    # A range straddling two epoch boundaries equals the same slice of the full order.
    assert np.array_equal(global_sample_ids(7, 17, n_samples=n, seed=5), full[7:24])
    # Pieces fetched out of order (cache churn) still agree with the whole.
    pieces = [global_sample_ids(s, 3, n_samples=n, seed=5) for s in (27, 0, 12, 3)]
    assert [p.tolist() for p in pieces] == [full[s:s + 3].tolist() for s in (27, 0, 12, 3)]


def test_global_sample_ids_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_samples must be > 0, got 0"):
        global_sample_ids(0, 1, n_samples=0, seed=0)
    with pytest.raises(ValueError, match="position_start=-1"):
        global_sample_ids(-1, 1, n_samples=5, seed=0)


# -- the loader ------------------------------------------------------------------------------------

def test_loader_is_deterministic_and_shapes_are_right():
    a = DataLoader(_source(), seed=0, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    b = DataLoader(_source(), seed=0, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    ba, bb = a.next_batch(), b.next_batch()
    assert ba.sample_ids == bb.sample_ids
    assert len(ba.inputs) == len(ba.targets) == 4
    for x, y in zip(ba.inputs, ba.targets):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, SEQ)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one token
    xa, ya = ba.stacked()
    assert xa.shape == (8, SEQ) and torch.equal(xa, bb.stacked()[0]) and torch.equal(ya, bb.stacked()[1])
    rows = np.stack([_source().sample(i) for i in ba.sample_ids])
    assert torch.equal(xa, torch.from_numpy(rows[:, :-1]))
    assert a.position.consumed_samples == 8
    c = DataLoader(_source(), seed=1, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    assert c.next_batch().sample_ids != ba.sample_ids


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_union_over_ranks_equals_single_rank_batch(dp):
    src = _source()
    single = _loaders(src, 1)[0]
    ranks = _loaders(src, dp)
    for _ in range(4):  # 32 samples over 20: crosses an epoch boundary
        want = single.next_batch()
        got = [ld.next_batch() for ld in ranks]
        assert sum((b.sample_ids for b in got), []) == want.sample_ids
        assert torch.equal(torch.cat([b.stacked()[0] for b in got]), want.stacked()[0])
        assert torch.equal(torch.cat([b.stacked()[1] for b in got]), want.stacked()[1])
        assert {ld.position.consumed_samples for ld in ranks} == {single.position.consumed_samples}


def test_dp_change_mid_run_neither_repeats_nor_skips():
    src, steps, k = _source(n=20), 7, 3
    straight = _run(_loaders(src, 1), steps)

    before = _loaders(src, 2)
    ids = _run(before, k)
    saved = json.loads(json.dumps(before[0].state_dict()))  # what a checkpoint would store
    assert all(ld.state_dict() == saved for ld in before)
    assert saved == {"consumed_samples": k * 8, "seed": 0}
    after = _loaders(src, 4, mbs=2, position=DataPosition.from_dict(saved))
    ids += _run(after, steps - k)

    assert ids == straight
    for e in range(len(ids) // 20):  # 56 samples: two whole epochs, each a permutation
        assert sorted(ids[e * 20:(e + 1) * 20]) == list(range(20))


def test_loaders_built_from_one_position_do_not_share_it():
    pos = DataPosition(consumed_samples=4, seed=0)
    loaders = _loaders(_source(), 2, position=pos)
    loaders[0].next_batch()
    assert pos.consumed_samples == 4
    assert loaders[1].position.consumed_samples == 4 and loaders[0].position.consumed_samples == 12


def test_load_state_dict_resumes_at_the_saved_position():
    a, b = _loaders(_source(), 1)[0], _loaders(_source(), 1)[0]
    a.next_batch()
    b.load_state_dict(a.state_dict())
    assert a.next_batch().sample_ids == b.next_batch().sample_ids


def test_data_position_round_trip_and_epoch():
    p = DataPosition(consumed_samples=45, seed=7)
    assert DataPosition.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert p.epoch(20) == 2 and p.epoch(46) == 0
    with pytest.raises(ValueError, match="consumed_samples"):
        DataPosition.from_dict({"seed": 0})
    with pytest.raises(ValueError, match="-3"):
        DataPosition.from_dict({"consumed_samples": -3, "seed": 0})


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(global_batch_size=10, micro_batch_size=1, dp_size=4), r"global_batch_size=10 .*dp_size=4"),
        (dict(global_batch_size=8, micro_batch_size=3, dp_size=2), r"per-rank batch 4 .*micro_batch_size=3"),
        (dict(global_batch_size=8, micro_batch_size=1, dp_size=2, dp_rank=2), r"dp_rank=2 .*dp_size=2"),
        (dict(global_batch_size=0, micro_batch_size=1, dp_size=1), r"global_batch_size=0"),
    ],
)
def test_bad_loader_arguments_name_the_numbers(kwargs, pattern):
    kwargs = {"dp_rank": 0, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        DataLoader(_source(), seed=0, **kwargs)


def test_resuming_with_another_seed_is_refused():
    with pytest.raises(ValueError, match="seed=1.*seed=2"):
        DataLoader(_source(), seed=2, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=1,
                   position=DataPosition(consumed_samples=4, seed=1))


# -- sources ---------------------------------------------------------------------------------------

def test_synthetic_source_is_seeded_per_sample():
    s = _source(n=5)
    x = s.sample(3)
    assert x.dtype == np.int64 and x.shape == (SEQ + 1,) and x.max() < 50 and x.min() >= 0
    assert np.array_equal(x, np.random.default_rng([0, 3]).integers(0, 50, SEQ + 1))
    assert not np.array_equal(x, _source(n=5, seed=1).sample(3))
    with pytest.raises(IndexError):
        s.sample(5)


@pytest.fixture
def corpus_dir(tmp_path):
    (tmp_path / "b.py").write_bytes(b"print('b')")
    (tmp_path / "a.py").write_bytes(b"x = 1")
    (tmp_path / "notes.txt").write_bytes(b"not python")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_bytes(b"def f():\n    return 3")
    return tmp_path


def test_corpus_concatenates_sorted_matching_files(corpus_dir):
    stream = b"x = 1\n" + b"print('b')\n" + b"def f():\n    return 3\n"
    src = CorpusSource(corpus_dir, seq_len=4, max_bytes=10_000)
    assert src.vocab_size == 256 and src.n_files == 3
    assert len(src) == (len(stream) - 1) // 4
    assert bytes(src.sample(0).astype(np.uint8)) == stream[0:5]
    assert bytes(src.sample(1).astype(np.uint8)) == stream[4:9]
    last = len(src) - 1
    assert bytes(src.sample(last).astype(np.uint8)) == stream[last * 4:last * 4 + 5]
    assert src.sample(0).dtype == np.int64


def test_corpus_suffix_filter_and_max_bytes(corpus_dir):
    txt = CorpusSource(corpus_dir, seq_len=2, max_bytes=10_000, suffixes=[".txt"])
    assert txt.n_files == 1 and bytes(txt.sample(0).astype(np.uint8)) == b"not"
    capped = CorpusSource(corpus_dir, seq_len=2, max_bytes=9)
    assert capped.n_files == 2  # the cap is reached inside the second file; the walk stops there
    assert len(capped) == (9 - 1) // 2
    assert bytes(capped.sample(3).astype(np.uint8)) == b"x = 1\nprint"[6:9]


def test_corpus_walk_order_is_sorted(tmp_path):
    # Created in reverse order, so an unsorted directory listing would very likely show up.
    for d in ("z", "m", "c"):
        (tmp_path / d).mkdir()
        for f in ("9.py", "5.py", "1.py"):
            (tmp_path / d / f).write_bytes(f"{d}{f[0]}".encode())
    (tmp_path / "top.py").write_bytes(b"T")
    src = CorpusSource(tmp_path, seq_len=2, max_bytes=1000)
    stream = bytes(np.concatenate([src.sample(i)[:-1] for i in range(len(src))]).astype(np.uint8))
    assert stream.startswith(b"T\nc1\nc5\nc9\nm1\nm5\nm9\nz1\nz5\nz")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks")
def test_corpus_skips_symlinked_dirs(corpus_dir):
    (corpus_dir / "zlink").symlink_to(corpus_dir / "sub", target_is_directory=True)
    assert CorpusSource(corpus_dir, seq_len=4, max_bytes=10_000).n_files == 3


def test_corpus_errors_are_clear(tmp_path, corpus_dir):
    with pytest.raises(ValueError, match=r"no readable files ending with \['.rs'\]"):
        CorpusSource(corpus_dir, seq_len=4, max_bytes=1000, suffixes=[".rs"])
    with pytest.raises(ValueError, match="need at least seq_len \\+ 1 = 1001"):
        CorpusSource(corpus_dir, seq_len=1000, max_bytes=10_000)
    with pytest.raises(ValueError, match="does not exist"):
        CorpusSource(tmp_path / "missing", seq_len=4, max_bytes=1000)


def test_default_corpus_is_the_stdlib():
    src = CorpusSource(None, seq_len=64, max_bytes=200_000)
    assert len(src) == (200_000 - 1) // 64
    xs = np.stack([src.sample(i) for i in (0, len(src) // 2, len(src) - 1)])
    assert xs.shape == (3, 65) and xs.min() >= 0 and xs.max() < 256
    assert b"import" in bytes(np.concatenate([src.sample(i) for i in range(50)]).astype(np.uint8))


@pytest.mark.parametrize("dtype, vocab", [("uint16", 60_000), ("uint32", 100_000)])
def test_token_file_round_trip(tmp_path, dtype, vocab):
    tokens = np.arange(0, 41, dtype=dtype) * (vocab // 41)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    src = TokenFileSource(path, seq_len=SEQ, vocab_size=vocab, dtype=dtype)
    assert len(src) == (41 - 1) // SEQ
    for i in range(len(src)):
        assert np.array_equal(src.sample(i), tokens[i * SEQ:i * SEQ + SEQ + 1].astype(np.int64))
    assert src.sample(1).dtype == np.int64
    again = pickle.loads(pickle.dumps(src))
    assert np.array_equal(again.sample(2), src.sample(2))


def test_token_file_source_pickles_without_the_tokens(tmp_path):
    path = tmp_path / "large.bin"
    np.arange(100_000, dtype=np.uint16).tofile(path)
    src = TokenFileSource(path, seq_len=SEQ, vocab_size=100_000)
    src.sample(0)  # opens the memmap
    blob = pickle.dumps(src)
    assert len(blob) < 10_000  # shipping a source to a worker must not copy the 200 kB file
    assert pickle.loads(blob).sample(3).tolist() == list(range(3 * SEQ, 4 * SEQ + 1))


def test_token_file_too_large_token_names_the_file(tmp_path):
    path = tmp_path / "big.bin"
    np.array([1, 2, 3, 70_000, 5], dtype=np.uint32).tofile(path)
    src = TokenFileSource(path, seq_len=2, vocab_size=65_536, dtype="uint32")
    assert src.sample(0).tolist() == [1, 2, 3]  # validated lazily: clean samples still load
    with pytest.raises(ValueError, match=r"big\.bin.*70000 >= model vocab_size=65536"):
        src.sample(1)


def test_token_file_bad_sizes(tmp_path):
    short = tmp_path / "short.bin"
    np.arange(4, dtype=np.uint16).tofile(short)
    with pytest.raises(ValueError, match="has 4 tokens; need at least seq_len \\+ 1 = 9"):
        TokenFileSource(short, seq_len=SEQ, vocab_size=10)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 42)
    with pytest.raises(ValueError, match="42 bytes, not a multiple of 4"):
        TokenFileSource(odd, seq_len=SEQ, vocab_size=10, dtype="uint32")


def test_build_source_follows_the_config(tmp_path, corpus_dir):
    syn = build_source(DataConfig(source="synthetic", seq_len=SEQ, num_samples=11), seed=3, vocab_size=99)
    assert isinstance(syn, SyntheticSource) and len(syn) == 11 and syn.vocab_size == 99
    same = SyntheticSource(num_samples=11, seq_len=SEQ, vocab_size=99, seed=3)
    assert np.array_equal(syn.sample(5), same.sample(5))
    assert not np.array_equal(syn.sample(0), build_source(
        DataConfig(source="synthetic", seq_len=SEQ, num_samples=11), seed=4, vocab_size=99).sample(0))
    corpus_cfg = DataConfig(source="corpus", path=str(corpus_dir), seq_len=4)
    corpus = build_source(corpus_cfg, seed=0, vocab_size=256)
    assert isinstance(corpus, CorpusSource) and corpus.n_files == 3
    with pytest.raises(ValueError, match="vocab_size >= 256, got 100"):
        build_source(corpus_cfg, seed=0, vocab_size=100)
    path = tmp_path / "t.bin"
    np.arange(20, dtype=np.uint32).tofile(path)
    tok = build_source(DataConfig(source="tokens", path=str(path), seq_len=4, token_dtype="uint32"),
                       seed=0, vocab_size=32)
    assert isinstance(tok, TokenFileSource) and tok.sample(1).tolist() == [4, 5, 6, 7, 8]


def test_batch_stacked_concatenates_micro_batches():
    b = Batch(inputs=[torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64)],
              targets=[torch.ones(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64)],
              sample_ids=[0, 1, 2, 3])
    x, y = b.stacked()
    assert x.shape == y.shape == (4, 3) and x[:2].sum() == 0 and x[2:].sum() == 6 and y[:2].sum() == 6


def test_a_missing_data_path_is_one_line_naming_the_field_where_the_rank_reads_it(tmp_path):
    from workers.config import ConfigError, JobConfig

    cfg = JobConfig.from_dict({"data": {"source": "corpus", "path": str(tmp_path / "gone")}})  # no disk check
    with pytest.raises(ConfigError, match=r"^data\.path '.*gone' does not exist$"):
        build_source(cfg.data, seed=0, vocab_size=256)


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 1025, 4096])
def test_the_computed_order_is_a_permutation_of_every_epoch(n):
    from workers.data import _feistel

    for epoch in (0, 1):
        assert sorted(_feistel(5, epoch, n, np.arange(n)).tolist()) == list(range(n))
    assert n < 3 or _feistel(5, 0, n, np.arange(n)).tolist() != _feistel(5, 1, n, np.arange(n)).tolist()


def test_a_huge_declared_data_set_allocates_only_the_batch():
    import tracemalloc

    from workers.data import PERMUTATION_IN_MEMORY

    n = 1 << 40  # data.num_samples' top: an 8 TiB permutation if it were held
    tracemalloc.start()
    try:
        ids = global_sample_ids(n - 32, 64, n_samples=n, seed=7)  # straddles two epochs
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and n > PERMUTATION_IN_MEMORY
    assert ids.min() >= 0 and ids.max() < n and len(set(ids[:32].tolist())) == 32 == len(set(ids[32:].tolist()))
    assert (ids == global_sample_ids(n - 32, 64, n_samples=n, seed=7)).all()

"""Deterministic training data whose position is a global count of consumed samples.

Elastic training changes the number of data-parallel ranks between steps. If each rank kept its own
cursor, a new DP degree would repeat or skip samples. Instead there is one global sample order (a
seeded permutation per epoch) and one global cursor, `DataPosition.consumed_samples`; step `s` always
takes global indices ``[consumed, consumed + global_batch_size)`` and each DP rank takes a contiguous
slice of that batch. The sequence of samples the job sees is therefore the same for every layout, and
a checkpoint only has to save two integers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from workers.config import DataConfig
from workers.disk_checks import check_data_path


class Source(Protocol):
    """Indexable samples: `sample(i)` is an int64 array of seq_len + 1 tokens in [0, vocab_size)."""

    vocab_size: int

    def __len__(self) -> int: ...

    def sample(self, idx: int) -> np.ndarray: ...


def _check_index(idx: int, n: int) -> None:
    if not 0 <= idx < n:
        raise IndexError(f"sample index {idx} out of range [0, {n})")


class SyntheticSource:
    """Seeded random tokens: needs no files, so tests and benchmarks run anywhere."""

    def __init__(self, *, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        if num_samples <= 0 or seq_len <= 0 or vocab_size <= 0:
            raise ValueError(f"num_samples={num_samples}, seq_len={seq_len} and vocab_size={vocab_size} "
                             "must all be > 0")
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, idx: int) -> np.ndarray:
        _check_index(idx, self.num_samples)
        # Seeding by (seed, idx) makes each sample independent of which others were drawn before it.
        rng = np.random.default_rng([self.seed, idx])
        return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64)


class _Windowed:
    """Fixed windows over one long token stream; consecutive samples overlap by one token so that every
    token except the first is a target exactly once."""

    seq_len: int

    def _n_tokens(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return (self._n_tokens() - 1) // self.seq_len

    def _window(self, idx: int) -> slice:
        _check_index(idx, len(self))
        return slice(idx * self.seq_len, idx * self.seq_len + self.seq_len + 1)


class CorpusSource(_Windowed):
    """Byte-level text (vocab 256) from the files under a directory, read into memory once.

    The default directory is the Python standard library source: it exists on every machine with
    Python, so a real-text run needs no download.
    """

    vocab_size = 256

    def __init__(self, path: str | os.PathLike[str] | None, *, seq_len: int, max_bytes: int,
                 suffixes: list[str] | tuple[str, ...] = (".py",)) -> None:
        if seq_len <= 0 or max_bytes <= 0:
            raise ValueError(f"seq_len={seq_len} and max_bytes={max_bytes} must be > 0")
        self.seq_len = seq_len
        self.root = Path(path if path is not None else sysconfig.get_paths()["stdlib"]).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"corpus directory {str(self.root)!r} does not exist or is not a directory")
        data, self.n_files = self._read(self.root, tuple(suffixes), max_bytes)
        if self.n_files == 0:
            raise ValueError(f"corpus directory {str(self.root)!r} has no readable files ending with "
                             f"{list(suffixes)}")
        if len(data) < seq_len + 1:
            raise ValueError(f"corpus {str(self.root)!r} has {len(data)} bytes in {self.n_files} files; "
                             f"need at least seq_len + 1 = {seq_len + 1}")
        self._bytes = np.frombuffer(data, dtype=np.uint8)

    @staticmethod
    def _read(root: Path, suffixes: tuple[str, ...], max_bytes: int) -> tuple[bytes, int]:
        parts: list[bytes] = []
        size = n_files = 0
        # os.walk does not descend into symlinked dirs (followlinks=False), so a link loop cannot hang us.
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()  # in place: fixes the walk order, so the corpus is the same on every machine
            for name in sorted(filenames):
                if not name.endswith(suffixes):
                    continue
                try:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        chunk = f.read(max_bytes - size)  # read no more than the cap needs
                except OSError:
                    continue  # unreadable files (permissions, dangling links) are not worth failing for
                parts.append(chunk + b"\n")
                size += len(chunk) + 1
                n_files += 1
                if size >= max_bytes:
                    return b"".join(parts)[:max_bytes], n_files
        return b"".join(parts), n_files

    def _n_tokens(self) -> int:
        return len(self._bytes)

    def sample(self, idx: int) -> np.ndarray:
        return self._bytes[self._window(idx)].astype(np.int64)


class TokenFileSource(_Windowed):
    """A flat file of pre-tokenised uint16/uint32 ids (nanoGPT-style), memory-mapped so that files
    larger than RAM work and several workers on one node share the page cache."""

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int, vocab_size: int,
                 dtype: str = "uint16") -> None:
        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"token dtype must be 'uint16' or 'uint32', got {dtype!r}")
        self.path, self.seq_len, self.vocab_size, self.dtype = str(path), seq_len, vocab_size, np.dtype(dtype)
        try:
            n_bytes = os.path.getsize(self.path)
        except OSError as e:
            raise ValueError(f"cannot read token file {self.path!r}: {e.strerror}") from None
        if n_bytes % self.dtype.itemsize:
            raise ValueError(f"token file {self.path!r} has {n_bytes} bytes, not a multiple of "
                             f"{self.dtype.itemsize} ({dtype}); wrong token_dtype?")
        self.n_tokens = n_bytes // self.dtype.itemsize
        if self.n_tokens < seq_len + 1:
            raise ValueError(f"token file {self.path!r} has {self.n_tokens} tokens; need at least "
                             f"seq_len + 1 = {seq_len + 1}")
        self._tokens: np.memmap | None = None  # opened on first use so the source pickles cheaply

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}  # pickling a memmap would copy the whole file

    def _n_tokens(self) -> int:
        return self.n_tokens

    def sample(self, idx: int) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        out = np.asarray(self._tokens[self._window(idx)], dtype=np.int64)
        # Checked per sample rather than up front: scanning a multi-GB file at start-up would be slow.
        if (bad := int(out.max())) >= self.vocab_size:
            raise ValueError(f"token file {self.path!r}: sample {idx} has token {bad} >= model "
                             f"vocab_size={self.vocab_size}; was it tokenised for another model?")
        return out


def check_token_meta(path: str, *, vocab_size: int, dtype: str) -> None:
    """Refuse, in one line, a token file whose `elastron data prepare` sidecar (meta.json) says it was
    made for a larger vocabulary or stored in another dtype than the job says. Files without a sidecar
    are checked per sample instead (`TokenFileSource.sample`)."""
    from workers.prepare import read_meta

    meta = read_meta(path)
    if not meta:
        return
    if int(meta.get("vocab_size", 0)) > vocab_size:
        raise ValueError(f"data.path: {path} was tokenised with a vocabulary of {meta['vocab_size']} tokens "
                         f"(meta.json), the model has {vocab_size}; use the model's tokenizer or a larger "
                         "model.vocab_size")
    if meta.get("dtype") not in (None, dtype):
        raise ValueError(f"data.token_dtype is {dtype} but {path} holds {meta['dtype']} ids (meta.json); "
                         f"set data.token_dtype: {meta['dtype']}")


def token_dtype(cfg: DataConfig) -> str:
    """data.token_dtype, else what meta.json beside data.path says, else uint16."""
    from workers.prepare import read_meta

    return cfg.token_dtype or (read_meta(cfg.path) or {}).get("dtype") or "uint16"


def build_source(cfg: DataConfig, *, seed: int, vocab_size: int) -> Source:
    """The source a `DataConfig` describes; `vocab_size` is the model's."""
    if cfg.source == "synthetic":
        return SyntheticSource(num_samples=cfg.num_samples, seq_len=cfg.seq_len, vocab_size=vocab_size,
                               seed=seed)
    check_data_path(cfg)  # here, where the path is read: a missing path is one line naming data.path
    if cfg.source == "corpus":
        if vocab_size < 256:
            raise ValueError(f"byte-level corpus needs model vocab_size >= 256, got {vocab_size}")
        return CorpusSource(cfg.path, seq_len=cfg.seq_len, max_bytes=cfg.max_bytes, suffixes=cfg.suffixes)
    if cfg.source == "tokens":
        if not cfg.path:
            raise ValueError("data.path is required when data.source is 'tokens'")
        dtype = token_dtype(cfg)
        check_token_meta(cfg.path, vocab_size=vocab_size, dtype=dtype)
        return TokenFileSource(cfg.path, seq_len=cfg.seq_len, vocab_size=vocab_size, dtype=dtype)
    raise ValueError(f"unknown data source {cfg.source!r}; expected corpus, synthetic or tokens")


def build_val_source(cfg: DataConfig, *, seed: int, vocab_size: int) -> Source:
    """The held-out split train.eval_interval evaluates: data.val_path, else for tokens the val.bin that
    `elastron data prepare` wrote beside data.path, for synthetic samples of another seed."""
    if cfg.source == "synthetic":
        return SyntheticSource(num_samples=cfg.num_samples, seq_len=cfg.seq_len, vocab_size=vocab_size,
                               seed=seed + 2**32)  # a stream no training seed (an int64) draws
    path = cfg.val_path
    if path is None and cfg.source == "tokens":
        from workers.prepare import read_meta

        beside = Path(cfg.path).parent / "val.bin"
        path = str(beside) if read_meta(cfg.path) is not None and beside.is_file() else None
    if path is None:
        raise ValueError("train.eval_interval needs a held-out split: set data.val_path, or point data.path at "
                         "the train.bin of `elastron data prepare` (it writes val.bin beside it)")
    return build_source(dataclasses.replace(cfg, path=path, val_path=None), seed=seed, vocab_size=vocab_size)


@dataclass(slots=True)
class DataPosition:
    """Where the data stream stands; all a checkpoint needs to resume it under any DP degree."""

    consumed_samples: int = 0
    """Samples consumed by the whole job (all DP ranks), i.e. the next global index."""
    seed: int = 0
    """Seeds the per-epoch permutations."""

    def epoch(self, n_samples: int) -> int:
        return self.consumed_samples // n_samples

    def to_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataPosition:
        try:
            consumed, seed = d["consumed_samples"], d["seed"]
        except (KeyError, TypeError):
            raise ValueError(f"data position needs consumed_samples and seed, got {d!r}") from None
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ValueError(f"data position consumed_samples must be an integer >= 0, got {consumed!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"data position seed must be an integer, got {seed!r}")
        return cls(consumed_samples=consumed, seed=seed)


PERMUTATION_IN_MEMORY = 1 << 22
"""Epochs of at most this many samples are shuffled by a permutation held in memory (32 MiB at most);
larger ones by `_feistel`, which computes each position's sample alone: a data set's declared size
(data.num_samples, up to 2^40) never sizes an allocation."""

_FEISTEL_ROUNDS = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@functools.lru_cache(maxsize=2)  # the current epoch, plus the next one while a batch straddles them
def _epoch_permutation(seed: int, epoch: int, n_samples: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(n_samples)
    perm.flags.writeable = False  # shared by every caller through the cache
    return perm


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a well-spread hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feistel(seed: int, epoch: int, n_samples: int, positions: np.ndarray) -> np.ndarray:
    """The sample at each of `positions` (0 <= p < n_samples) of epoch `epoch`'s order: a keyed Feistel
    network over the smallest even power of two >= n_samples, walked again from any value >= n_samples
    until it lands inside (cycle walking: a bijection of [0, n_samples), each value found in fewer than 4
    walks on average). Memory proportional to len(positions) only."""
    half = max(1, (int(n_samples - 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = [np.uint64(k) for k in np.random.default_rng([seed, epoch, 1]).integers(0, 1 << 63, _FEISTEL_ROUNDS)]
    x = positions.astype(np.uint64)
    todo = np.ones(len(x), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            left, right = x[todo] >> np.uint64(half), x[todo] & low
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & low)
            x[todo] = (left << np.uint64(half)) | right
            todo = x >= np.uint64(n_samples)
    return x.astype(np.int64)


def global_sample_ids(position_start: int, count: int, *, n_samples: int, seed: int) -> np.ndarray:
    """Sample ids at global indices [position_start, position_start + count).

    Global index g is in epoch g // n_samples, whose order is a permutation seeded by (seed, epoch), so
    every sample is seen exactly once per epoch and the order never depends on the DP degree. Epochs
    larger than PERMUTATION_IN_MEMORY compute the permutation per position (`_feistel`).
    """
    if n_samples <= 0:
        raise ValueError(f"n_samples must be > 0, got {n_samples}")
    if position_start < 0 or count < 0:
        raise ValueError(f"position_start={position_start} and count={count} must be >= 0")
    out = np.empty(count, dtype=np.int64)
    done = 0
    while done < count:
        epoch, offset = divmod(position_start + done, n_samples)
        take = min(count - done, n_samples - offset)
        if n_samples <= PERMUTATION_IN_MEMORY:
            out[done:done + take] = _epoch_permutation(seed, epoch, n_samples)[offset:offset + take]
        else:
            out[done:done + take] = _feistel(seed, epoch, n_samples, np.arange(offset, offset + take, dtype=np.int64))
        done += take
    return out


@dataclass(slots=True)
class Batch:
    """One DP rank's share of a global batch, already split into micro-batches."""

    inputs: list[torch.Tensor]
    """Per micro-batch, int64 [micro_batch, seq_len]."""
    targets: list[torch.Tensor]
    """Per micro-batch, int64 [micro_batch, seq_len]: the inputs shifted left by one token."""
    sample_ids: list[int]
    """Ids of this rank's samples, in order (lets tests prove nothing is repeated or skipped)."""

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All of this rank's samples as one [per_rank, seq_len] (inputs, targets) pair."""
        return torch.cat(self.inputs), torch.cat(self.targets)


class DataLoader:
    """Yields this DP rank's share of each global batch and advances the global position."""

    def __init__(self, source: Source, *, seed: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, position: DataPosition | None = None) -> None:
        if global_batch_size <= 0 or micro_batch_size <= 0 or dp_size <= 0:
            raise ValueError(f"global_batch_size={global_batch_size}, micro_batch_size={micro_batch_size} "
                             f"and dp_size={dp_size} must all be > 0")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
        per_rank = global_batch_size // dp_size
        if per_rank % micro_batch_size:
            raise ValueError(f"per-rank batch {per_rank} (global_batch_size={global_batch_size} / "
                             f"dp_size={dp_size}) is not divisible by micro_batch_size={micro_batch_size}")
        if len(source) == 0:
            raise ValueError("data source has no samples")
        self.source, self.seed = source, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.per_rank = dp_rank, dp_size, per_rank
        self.position = DataPosition(seed=seed)
        if position is not None:
            self.load_state_dict(position.to_dict())

    def next_batch(self) -> Batch:
        start = self.position.consumed_samples + self.dp_rank * self.per_rank
        ids = global_sample_ids(start, self.per_rank, n_samples=len(self.source), seed=self.seed)
        tokens = torch.from_numpy(np.stack([self.source.sample(int(i)) for i in ids]))
        inputs = [t.contiguous() for t in tokens[:, :-1].split(self.micro_batch_size)]
        targets = [t.contiguous() for t in tokens[:, 1:].split(self.micro_batch_size)]
        # Advance only after the reads succeeded, so a failed step can be retried at the same position.
        self.position.consumed_samples += self.global_batch_size
        return Batch(inputs=inputs, targets=targets, sample_ids=[int(i) for i in ids])

    def state_dict(self) -> dict[str, int]:
        return self.position.to_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        pos = DataPosition.from_dict(d)
        if pos.seed != self.seed:
            # Resuming under another seed would reorder the current epoch: repeats and skips.
            raise ValueError(f"data position was saved with seed={pos.seed}, but this loader uses "
                             f"seed={self.seed}")
        self.position = pos  # a fresh object: loaders built from one saved position never share it

"""`elastron data prepare`: text files, JSONL and Parquet -> the flat token files the trainer reads.

Input: files or directories (searched recursively) of `.txt`/`.md` (one document per file), `.jsonl`
(one document per line, its `text_field`) and `.parquet` (one document per row of `text_field`).
Documents are tokenised with a Hugging Face `tokenizers` tokenizer (a `tokenizer.json`, or a model
directory holding one) in batches (the tokenizers library encodes a batch on all cores), an EOS token is
appended to every document (and a BOS token put before it with `add_bos`, by default when the
tokenizer's config says `add_bos_token`), and each document goes whole to the training or the validation
split (chosen by a seeded hash of its position, so the split is reproducible and independent of batching).
Invalid UTF-8 becomes U+FFFD and blank documents are skipped; both are counted, reported and stored.

Output, in `out`: `train.bin` and `val.bin` (nanoGPT-style flat uint16 ids, uint32 when the vocabulary
needs it: `data.source: tokens`, `data.path`, `data.token_dtype`) and `meta.json`, the sidecar the
trainer checks: dtype, vocab size, tokenizer digest, documents and tokens per split, EOS (and BOS) id,
replaced invalid UTF-8 sequences, skipped empty documents, sources. Files are written under temporary
names and renamed at the end: an interrupted run, or one that produced no training token, leaves no
half-written split that looks complete (and no output directory it created).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
META = "meta.json"


class PrepareError(ValueError):
    """Bad input to `prepare`; the message is one line saying what and how to fix it."""


@dataclass(slots=True)
class Split:
    path: Path
    dtype: np.dtype
    documents: int = 0
    tokens: int = 0
    _f: object = field(default=None, repr=False)

    def open(self) -> None:
        self._f = open(self.path.with_suffix(".bin.part"), "wb")

    def add(self, ids: list[int]) -> None:
        np.asarray(ids, dtype=self.dtype).tofile(self._f)
        self.documents += 1
        self.tokens += len(ids)

    def close(self, ok: bool) -> None:
        self._f.close()
        part = self.path.with_suffix(".bin.part")
        if ok:
            os.replace(part, self.path)
        else:
            part.unlink(missing_ok=True)


def _tokenizer_file(path: Path) -> Path:
    f = path / "tokenizer.json" if path.is_dir() else path
    if not f.is_file():
        raise PrepareError(f"tokenizer: {f} does not exist; pass a tokenizer.json or a model directory holding one")
    return f


def tokenizer_digest(path: str | os.PathLike[str]) -> str | None:
    """sha256 of the tokenizer.json at `path` (a file or a directory holding one); None if there is none.
    meta.json records it, so data can be matched with a model's own tokenizer."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    try:
        return hashlib.sha256(f.read_bytes()).hexdigest()
    except OSError:
        return None


def bos_id(path: str | os.PathLike[str], tok) -> tuple[int | None, bool]:
    """(the BOS id tokenizer_config.json names, whether it says add_bos_token)."""
    cfg = _tokenizer_file(Path(path)).parent / "tokenizer_config.json"
    try:
        d = json.loads(cfg.read_text()) if cfg.is_file() else {}
    except (OSError, ValueError):
        d = {}
    name = d.get("bos_token")
    name = name.get("content") if isinstance(name, dict) else name
    bos = tok.token_to_id(name) if isinstance(name, str) else None
    return bos, bool(d.get("add_bos_token")) and bos is not None


def _decode(data: bytes) -> tuple[str, int]:
    """(text, number of invalid UTF-8 sequences replaced by U+FFFD)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")


def load_tokenizer(path: str | os.PathLike[str]):
    """(tokenizer, eos id, sha256 of tokenizer.json)."""
    from tokenizers import Tokenizer

    f = _tokenizer_file(Path(path))
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # the library raises its own exception types for a malformed file
        raise PrepareError(f"tokenizer: cannot load {f}: {e}") from None
    eos = None
    cfg = f.parent / "tokenizer_config.json"
    if cfg.is_file():
        try:
            name = json.loads(cfg.read_text()).get("eos_token")
            name = name.get("content") if isinstance(name, dict) else name
            eos = tok.token_to_id(name) if isinstance(name, str) else None
        except (OSError, ValueError):
            eos = None
    for name in EOS_CANDIDATES:
        if eos is None:
            eos = tok.token_to_id(name)
    if eos is None:
        raise PrepareError(f"tokenizer: {f} has no end-of-document token (looked for tokenizer_config.json's "
                           f"eos_token and {', '.join(EOS_CANDIDATES)})")
    return tok, eos, hashlib.sha256(f.read_bytes()).hexdigest()


def find_inputs(inputs: list[str | os.PathLike[str]]) -> list[Path]:
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (*TEXT_SUFFIXES, ".jsonl", ".parquet"))
        elif p.is_file():
            out.append(p)
        else:
            raise PrepareError(f"input {p} does not exist")
    if not out:
        raise PrepareError(f"no .txt, .md, .jsonl or .parquet files under {', '.join(map(str, inputs))}")
    return out


@dataclass(slots=True)
class Counts:
    """What reading the inputs replaced or skipped, for the report and meta.json."""

    invalid_utf8: int = 0
    """Invalid UTF-8 sequences replaced by U+FFFD."""
    empty_documents: int = 0
    """Documents with no text but whitespace, skipped."""
    bytes_read: int = 0


def documents(path: Path, text_field: str, counts: Counts | None = None) -> Iterator[str]:
    """The documents of one input file, in order (blank ones included; `prepare` skips them)."""
    counts = counts if counts is not None else Counts()
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                counts.bytes_read += len(raw)
                line, bad = _decode(raw)
                counts.invalid_utf8 += bad
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise PrepareError(f"{path}:{n}: not JSON ({e})") from None
                text = rec.get(text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str):
                    raise PrepareError(f"{path}:{n}: no string field {text_field!r}; pass --text-field")
                yield text
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None

        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise PrepareError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                               "pass --text-field")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))
    elif path.suffix in TEXT_SUFFIXES:
        data = path.read_bytes()
        counts.bytes_read += len(data)
        text, bad = _decode(data)
        counts.invalid_utf8 += bad
        yield text
    else:
        raise PrepareError(f"{path}: unsupported file type {path.suffix!r} (use .txt, .md, .jsonl or .parquet)")


def _to_val(seed: int, index: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


def prepare(inputs: list[str | os.PathLike[str]], out: str | os.PathLike[str], *, tokenizer: str | os.PathLike[str],
            text_field: str = "text", val_fraction: float = 0.01, seed: int = 0, batch_size: int = 256,
            progress: Callable[[int, int], None] | None = None, add_bos: bool | None = None) -> dict:
    """Tokenise `inputs` into `out`/{train,val}.bin + meta.json; returns the sidecar. `progress(bytes
    done, bytes total)` (of the input files) is called after each file. `add_bos`: put the tokenizer's BOS token before every
    document (None: as its tokenizer_config.json's add_bos_token says)."""
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"val_fraction must be in [0, 1), got {val_fraction}")
    files = find_inputs(inputs)
    tok, eos, digest = load_tokenizer(tokenizer)
    bos, bos_default = bos_id(tokenizer, tok)
    if add_bos and bos is None:
        raise PrepareError(f"--add-bos: the tokenizer at {tokenizer} names no bos_token in tokenizer_config.json")
    bos = bos if (bos_default if add_bos is None else add_bos) else None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    out = Path(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    counts = Counts()
    splits = {"train": Split(out / "train.bin", dtype), "val": Split(out / "val.bin", dtype)}
    for s in splits.values():
        s.open()
    ok = False
    index = 0
    sizes = [os.path.getsize(p) for p in files]
    total, done_bytes = sum(sizes), 0
    try:
        for path, size in zip(files, sizes):
            batch: list[str] = []
            for text in documents(path, text_field, counts):
                if not text.strip():
                    counts.empty_documents += 1
                    continue
                batch.append(text)
                if len(batch) == batch_size:
                    index = _write(tok, eos, bos, batch, index, splits, seed, val_fraction)
                    batch = []
            index = _write(tok, eos, bos, batch, index, splits, seed, val_fraction)
            done_bytes += size
            if progress is not None:
                progress(done_bytes, total)
        ok = splits["train"].tokens > 0
    finally:
        for s in splits.values():
            s.close(ok)
        if not ok and created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if nothing else is in it
    if not ok:
        raise PrepareError(f"no training tokens were produced: the inputs hold no text ({counts.empty_documents} "
                           "empty document(s) skipped); nothing was written")
    meta = {
        "format": "elastron-tokens", "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos, "bos_id": bos,
        "tokenizer_sha256": digest, "tokenizer": str(_tokenizer_file(Path(tokenizer)).absolute()),
        "documents": {k: s.documents for k, s in splits.items()}, "tokens": {k: s.tokens for k, s in splits.items()},
        "invalid_utf8_replaced": counts.invalid_utf8, "empty_documents_skipped": counts.empty_documents,
        "val_fraction": val_fraction, "seed": seed, "sources": [str(p) for p in files],
    }
    if counts.invalid_utf8 or counts.empty_documents:
        log.warning("data prepare: replaced %d invalid UTF-8 sequence(s) with U+FFFD and skipped %d empty "
                    "document(s) (counted in %s)", counts.invalid_utf8, counts.empty_documents, out / META)
    tmp = out / (META + ".part")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out / META)
    return meta


def _write(tok, eos: int, bos: int | None, batch: list[str], index: int, splits: dict[str, Split], seed: int,
           val_fraction: float) -> int:
    if not batch:
        return index
    head = [bos] if bos is not None else []
    for enc in tok.encode_batch(batch, add_special_tokens=False):
        splits["val" if _to_val(seed, index, val_fraction) else "train"].add([*head, *enc.ids, eos])
        index += 1
    return index


def read_meta(token_file: str | os.PathLike[str]) -> dict | None:
    """The sidecar next to a token file written by `prepare`, if any."""
    p = Path(token_file).parent / META
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

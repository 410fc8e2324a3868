"""`elastron data prepare`: text files, JSONL and Parquet -> the flat token files the trainer reads.

Input: files or directories (searched recursively) of `.txt`/`.md` (one document per file), `.jsonl`
(one document per line, its `text_field`) and `.parquet` (one document per row of `text_field`).
Documents are tokenised with a Hugging Face `tokenizers` tokenizer (a `tokenizer.json`, or a model
directory holding one) in batches (the tokenizers library encodes a batch on all cores), an EOS token is
appended to every document, and each document goes whole to the training or the validation split
(chosen by a seeded hash of its position, so the split is reproducible and independent of batching).

Output, in `out`: `train.bin` and `val.bin` (nanoGPT-style flat uint16 ids, uint32 when the vocabulary
needs it: `data.source: tokens`, `data.path`, `data.token_dtype`) and `meta.json`, the sidecar the
trainer checks: dtype, vocab size, tokenizer digest, documents and tokens per split, EOS id, sources.
Files are written under temporary names and renamed at the end: an interrupted run leaves no
half-written split that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

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


def documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one input file, in order."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
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
        yield path.read_text(encoding="utf-8", errors="replace")
    else:
        raise PrepareError(f"{path}: unsupported file type {path.suffix!r} (use .txt, .md, .jsonl or .parquet)")


def _to_val(seed: int, index: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


def prepare(inputs: list[str | os.PathLike[str]], out: str | os.PathLike[str], *, tokenizer: str | os.PathLike[str],
            text_field: str = "text", val_fraction: float = 0.01, seed: int = 0, batch_size: int = 256,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenise `inputs` into `out`/{train,val}.bin + meta.json; returns the sidecar. `progress(files
    done, files total)` is called after each file."""
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"val_fraction must be in [0, 1), got {val_fraction}")
    files = find_inputs(inputs)
    tok, eos, digest = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": Split(out / "train.bin", dtype), "val": Split(out / "val.bin", dtype)}
    for s in splits.values():
        s.open()
    ok = False
    index = 0
    try:
        for done, path in enumerate(files, 1):
            batch: list[str] = []
            for text in documents(path, text_field):
                batch.append(text)
                if len(batch) == batch_size:
                    index = _write(tok, eos, batch, index, splits, seed, val_fraction)
                    batch = []
            index = _write(tok, eos, batch, index, splits, seed, val_fraction)
            if progress is not None:
                progress(done, len(files))
        ok = True
    finally:
        for s in splits.values():
            s.close(ok)
    if splits["train"].tokens == 0:
        raise PrepareError("no training tokens were produced (are the inputs empty?)")
    meta = {
        "format": "elastron-tokens", "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos,
        "tokenizer_sha256": digest, "tokenizer": str(_tokenizer_file(Path(tokenizer))),
        "documents": {k: s.documents for k, s in splits.items()}, "tokens": {k: s.tokens for k, s in splits.items()},
        "val_fraction": val_fraction, "seed": seed, "sources": [str(p) for p in files],
    }
    tmp = out / (META + ".part")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out / META)
    return meta


def _write(tok, eos: int, batch: list[str], index: int, splits: dict[str, Split], seed: int,
           val_fraction: float) -> int:
    if not batch:
        return index
    for enc in tok.encode_batch(batch, add_special_tokens=False):
        splits["val" if _to_val(seed, index, val_fraction) else "train"].add([*enc.ids, eos])
        index += 1
    return index


def read_meta(token_file: str | os.PathLike[str]) -> dict | None:
    """The sidecar next to a token file written by `prepare`, if any."""
    p = Path(token_file).parent / META
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

"""The checks of a checkpoint's description before a load trusts it: chunks that fit their tensors and
files and tile them without overlap or holes, a rank's boxes covered, the model's shapes matched.

Pure: no torch import (`ITEMSIZE` gives the dtypes' sizes), so `inspect` and the CLI can check cheaply."""

from __future__ import annotations

import math
from typing import Callable

from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.keys import OPTIM_PREFIX, param_of

ITEMSIZE = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
"""Bytes per element of the dtypes a checkpoint may hold (lets the manifest be checked without torch)."""


def dtype_problems(tensors: dict[str, TensorEntry]) -> list[str]:
    """Tensors of a dtype a checkpoint may not hold."""
    return [f"tensor {key}: unsupported dtype {t.dtype!r}" for key, t in tensors.items() if t.dtype not in ITEMSIZE]


def structure_problems(tensors: dict[str, TensorEntry], files: dict[str, FileEntry]) -> list[str]:
    """Chunks that fall outside their tensor, overlap, leave holes, or name unlisted files; files too
    small for the chunks they are said to hold (so a forged manifest cannot make a loader allocate more
    than the checkpoint's size): the whole of a checkpoint, every chunk of every tensor."""
    problems: list[str] = []
    in_file: dict[str, int] = dict.fromkeys(files, 0)
    for key, t in tensors.items():
        if t.dtype not in ITEMSIZE:
            problems.append(f"tensor {key}: unsupported dtype {t.dtype!r}")
            continue
        covered = 0
        boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for c in t.chunks:
            found, fits = _chunk_problems(key, c, t, files, in_file, lister="the manifest")
            problems += found
            if fits:
                boxes.append((c.offsets, c.sizes))
                covered += math.prod(c.sizes)
        problems += [f"tensor {key}: chunks at {list(a)} and {list(b)} overlap" for a, b in _overlapping(boxes)]
        if covered != math.prod(t.shape):
            problems.append(f"tensor {key}: chunks cover {covered} of {math.prod(t.shape)} elements")
    for name, nbytes in sorted(in_file.items()):
        if nbytes > files[name].size:
            problems.append(f"file {name}: its chunks need {nbytes} bytes but the file has {files[name].size}")
    return problems


def coverage_problems(tensors: dict[str, TensorEntry], optimizer_steps: dict[str, int],
                      boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
    """Whether the chunks of `tensors` (those of the indexes a rank read) tile each of `boxes` (key ->
    (offsets, sizes) the rank loads) exactly, and every parameter whose moments it loads has its step
    counter in `optimizer_steps`."""
    problems: list[str] = []
    for key, (offsets, sizes) in sorted(boxes.items()):
        t = tensors.get(key)
        if t is None:
            problems.append(f"the checkpoint has no tensor {key}")
            continue
        meet = t.meeting(offsets, sizes)
        covered = sum(math.prod(min(a + n, b + m) - max(a, b) for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes))
                      for c in meet)
        problems += [f"tensor {key}: chunks at {list(a)} and {list(b)} overlap"
                     for a, b in _overlapping([(c.offsets, c.sizes) for c in meet])]
        if covered != math.prod(sizes):
            problems.append(f"tensor {key}: the indexes read cover {covered} of the {math.prod(sizes)} elements "
                            f"of the box at {list(offsets)} (an index is missing chunks)")
        if key.startswith(OPTIM_PREFIX) and param_of(key) not in optimizer_steps:
            problems.append(f"tensor {key}: no index read has the optimizer step of its parameter")
    return problems


def model_problems(have: dict[str, TensorEntry], expected: dict[str, tuple[tuple[int, ...], str]], *,
                   parameters: int | None = None, held: Callable[[str], bool] | None = None) -> list[str]:
    """Differences between the checkpoint's model tensors `have` (canonical name -> entry) and the model
    about to receive them (`expected`: canonical name -> (global shape, dtype name)). Shape mismatches
    come first: they show both shapes, the clearest sign of a different model when only the first
    problem is shown. `parameters`: `have` holds only the parameters for which `held` is true, of this
    many in the checkpoint (a format-4 manifest with some sections read): the count is compared, and
    only those parameters."""
    shapes, others = [], []
    if parameters is not None:
        if len(expected) != parameters:
            others.append(f"the checkpoint has {parameters} parameters but the model {len(expected)} "
                          "(different model shape)")
        expected = {n: v for n, v in expected.items() if held(n)}
    for name, (shape, dtype) in sorted(expected.items()):
        t = have.get(name)
        if t is None:
            others.append(f"model parameter {name} is missing from the checkpoint")
        elif tuple(t.shape) != tuple(shape):
            shapes.append(f"model parameter {name} has shape {list(t.shape)} in the checkpoint but "
                          f"{list(shape)} in the model (different model shape)")
        elif t.dtype != dtype:
            others.append(f"model parameter {name} is {t.dtype} in the checkpoint but {dtype} in the model")
    extra = sorted(set(have) - set(expected))
    if extra:
        others.append(f"checkpoint has {len(extra)} parameter(s) the model does not, e.g. {extra[0]} "
                      "(different model shape)")
    return shapes + others


def index_problems(where: str, chunks: dict[str, Chunk], files: dict[str, FileEntry],
                   tensors: dict[str, TensorEntry]) -> list[str]:
    """The problems of one index (`where`, its file name): chunks of tensors the top manifest does not
    have, or that fall outside their tensor, name a file the index does not list, or lack block digests;
    files too small for their chunks."""
    out: list[str] = []
    in_file = dict.fromkeys(files, 0)
    for key, c in sorted(chunks.items()):
        t = tensors.get(key)
        if t is None:
            out.append(f"{where}: tensor {key} is not in the manifest")
            continue
        out += _chunk_problems(key, c, t, files, in_file, lister=where)[0]
    out += [f"file {n}: its chunks need {b} bytes but the file has {files[n].size}"
            for n, b in sorted(in_file.items()) if b > files[n].size]
    return out


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The offsets of every pair of boxes (offsets, sizes) that overlap. A sweep along dim 0 compares a
    box only with those whose rows it shares, so a tensor's chunks (a grid: rows of FSDP shards, columns
    of TP shards) cost about (chunks x columns), not chunks squared."""
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if boxes and not boxes[0][0]:  # 0-d: any second chunk overlaps the first
        return [(o, boxes[0][0]) for o, _ in boxes[1:]]
    active: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []  # (row end, offsets, sizes)
    for o, n in sorted(boxes):
        active = [x for x in active if x[0] > o[0]]
        for _, o2, n2 in active:
            if all(a < b + m and b < a + k for a, k, b, m in zip(o, n, o2, n2)):
                out.append((o, o2))
        active.append((o[0] + n[0], o, n))
    return out


def _chunk_problems(key: str, c: Chunk, t: TensorEntry, files: dict[str, FileEntry], in_file: dict[str, int], *,
                    lister: str) -> tuple[list[str], bool]:
    """One chunk's problems: a file `lister` (the manifest, an index) does not list, a box outside its
    tensor (then nothing more is checked), its block digests. Adds its bytes to `in_file`; returns the
    problems and whether it fits its tensor."""
    out = [f"tensor {key}: chunk in file {c.file!r}, which {lister} does not list"] if c.file not in files else []
    if not _fits(c, t):
        return out + [f"tensor {key}: chunk offsets {list(c.offsets)} sizes {list(c.sizes)} "
                      f"do not fit shape {list(t.shape)}"], False
    if t.dtype in ITEMSIZE and c.file in in_file:
        in_file[c.file] += math.prod(c.sizes) * ITEMSIZE[t.dtype]
    return out + _block_problems(key, c, files.get(c.file)), True


def _block_problems(key: str, c: Chunk, f: FileEntry | None) -> list[str]:
    if f is None or not f.blockwise:
        return []
    if c.block_rows < 1:
        return [f"tensor {key}: chunk in {c.file} has no checksum blocks"]
    if c.blocks is not None:  # a part read by a loader: checked against its record as it was read
        b0, b1 = c.blocks
        if f.algorithm != "none" and not (0 <= b0 <= b1 <= c.n_blocks and len(c.digests) == b1 - b0):
            return [f"tensor {key}: chunk in {c.file} has {len(c.digests)} digests for its blocks {b0}-{b1} "
                    f"of {c.n_blocks}"]
        return []
    if f.algorithm != "none" and len(c.digests) != c.n_blocks:
        return [f"tensor {key}: chunk in {c.file} has {len(c.digests)} block digests, expected {c.n_blocks}"]
    return []


def _fits(c: Chunk, t: TensorEntry) -> bool:
    return len(c.offsets) == len(t.shape) and len(c.sizes) == len(t.shape) and all(
        o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(c.offsets, c.sizes, t.shape))

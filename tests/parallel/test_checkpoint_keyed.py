"""Tier 1: keyed format-3 indexes (`index.Index.to_bytes` with a key order, `validate.read_indexes`
with the keys a rank meets), pure: no torch.distributed, indexes written to a temporary directory.

A loading rank must read, of each index it needs, the preamble, the header, the records of exactly
the chunks that meet its boxes (found here by scanning every saved rank's boxes, which the loader
avoids) and the digests of exactly the blocks of those chunks whose rows meet its boxes, and nothing
else; a damaged key table must be a clear error naming the file.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from models.config import model_config
from models.llama import build_model
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.errors import CheckpointError, ManifestError
from parallel.checkpoint.formats import KEYED_INDEX_VERSION, PREAMBLE_BYTES, index_name, shard_prefix
from parallel.checkpoint.index import Index
from parallel.checkpoint.keys import key_order
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.placement import Placement, index_keys_for, shared, writes
from parallel.checkpoint.storage import LocalStorage
from parallel.checkpoint.validate import read_indexes
from parallel.layout import Layout

STATES = ("exp_avg", "exp_avg_sq")
# Uneven: 3 layers over pp=2, vocab 37 and ffn 45 over tp=2 and dp_shard=3.
CFG = model_config("tiny", n_layers=3, dim=24, n_heads=4, n_kv_heads=2, ffn_hidden=45, vocab_size=37)
PARAMS = {n: (tuple(p.shape), "float32") for n, p in build_model(CFG).named_parameters()}


class CountingStorage(LocalStorage):
    """Local files, remembering every read: (file name, start, bytes) per range, and whole reads."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.ranges: list[tuple[str, int, bytes]] = []
        self.whole: list[str] = []

    def read_ranges(self, path, ranges):
        out = super().read_ranges(path, ranges)
        self.ranges += [(path.rsplit("/", 1)[-1], a, got) for (a, _), got in zip(ranges, out)]
        return out

    def read_bytes(self, path):
        self.whole.append(path.rsplit("/", 1)[-1])
        return super().read_bytes(path)


def _file(w: int) -> str:
    return f"{shard_prefix(w)}00.safetensors"


def _rows(b) -> int:
    """Rows per block of a saved box: three blocks or fewer per chunk."""
    return max(1, -(-b.sizes[0] // 3)) if b.sizes else 1


def _digests(w: int, key: str, b) -> tuple[str, ...]:
    """Distinct 32-character digests, one per block (the box's writer, key and block number in them)."""
    n = -(-(b.sizes[0] if b.sizes else 1) // _rows(b))
    return tuple(f"{w:04x}{abs(hash(key)) % (1 << 64):016x}{i:012x}" for i in range(n))


def save(tmp_path, layout: Layout) -> tuple[Manifest, list]:
    """Write the indexes (keyed) and the top manifest of a checkpoint saved under `layout`, as a placed
    save writes them (fake digests, no data files); return the manifest and what each rank wrote."""
    placement = Placement(layout=layout, n_layers=3, params=PARAMS)
    bm = placement.boxmap(STATES)
    keys = {f"{p}{n}": s for n, (s, _) in PARAMS.items() for p in ("model.", *(f"optim.{st}." for st in STATES))}
    top = Manifest(step=5, tensors={k: TensorEntry(shape=s, dtype="float32", chunks=()) for k, s in keys.items()},
                   files={}, format_version=3, placement=placement.to_dict(), indexes=layout.world_size, scope="top")
    top = Manifest.from_json(top.to_json())
    order = key_order(top.tensors)
    wrote = []
    for w in range(layout.world_size):
        for sh in (False, True):
            boxes = {k: b for k, b in bm.held(w).items() if writes(bm, w, k) and shared(bm, k, bm.tile_of(w, k)) == sh}
            if not boxes:
                continue
            wrote += [(w, k, b, sh) for k, b in boxes.items()]
            chunks = {k: Chunk(file=_file(w), offsets=b.offsets, sizes=b.sizes, block_rows=_rows(b),
                               digests=_digests(w, k, b)) for k, b in boxes.items()}
            index = Index(rank=w, step=5, shared=sh, chunks=chunks, optimizer_steps={n: 5 for n in PARAMS},
                          files={_file(w): FileEntry(size=1 << 20, digest="cd" * 16, algorithm="xxh3-128",
                                                     blockwise=True)})
            (tmp_path / index_name(w, sh)).write_bytes(index.to_bytes(order))
    return top, wrote


@pytest.mark.parametrize("old,new", [("dp_shard=8", "dp_shard=6"), ("dp_shard=2,tp=2,pp=2", "dp_shard=3,tp=1")])
def test_a_loader_reads_exactly_the_records_of_the_keys_its_boxes_meet(tmp_path, old, new):
    top, wrote = save(tmp_path, Layout.parse(old))
    placement = top.placement_of()
    loading = Placement(layout=Layout.parse(new), n_layers=3, params=PARAMS).boxmap(STATES)
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    partial = []  # (bytes read, their indexes' whole size) per rank
    for rank in range(Layout.parse(new).world_size):
        mine = loading.held(rank)
        st = CountingStorage(str(tmp_path))
        wanted = index_keys_for(placement.boxmap(top.optimizer_states()), mine)
        boxes = {k: (b.offsets, b.sizes) for k, b in mine.items()}
        indexes, problems = read_indexes(st, str(tmp_path), top, wanted, boxes=boxes)
        assert problems == [] and st.whole == []
        part, more = top.merged(indexes, whole=False)
        assert more == [] and part.coverage_problems(boxes) == []
        # Per index: the preamble, the header, whole records only, then digests only, each read once.
        got: Counter = Counter()
        digest_bytes = 0
        for name in {n for n, _, _ in st.ranges}:
            reads = sorted((a, data) for n, a, data in st.ranges if n == name)
            assert reads[0][0] == 0 and len(reads[0][1]) == PREAMBLE_BYTES
            assert reads[1][0] == PREAMBLE_BYTES and reads[1][1].endswith(b"\n")
            end = PREAMBLE_BYTES + len(reads[1][1])
            for a, data in reads[2:]:
                assert a >= end, f"{name}: ranges that overlap"
                end = a + len(data)
                if not data.endswith(b"\n"):  # the digest section (after every record)
                    assert b"\n" not in data and len(data) % 32 == 0
                    digest_bytes += len(data)
                    continue
                for line in data.split(b"\n")[:-1]:
                    rec = json.loads(line)
                    got[(name, tuple(rec["offsets"]), tuple(rec["sizes"]))] += 1
            assert end <= sizes[name]
        meeting = [(w, k, b, sh) for w, k, b, sh in wrote if k in mine and mine[k].intersect(b) is not None]
        want = Counter((index_name(w, sh), tuple(b.offsets), tuple(b.sizes)) for w, k, b, sh in meeting)
        assert got == want, f"{old} -> {new}, rank {rank}"
        # Digests: those of the blocks whose rows meet the rank's box, found by a scan of every block.
        want_digests = {}
        for w, k, b, sh in meeting:
            n = b.sizes[0] if b.sizes else 1
            lo, hi = (mine[k].offsets[0], mine[k].offsets[0] + mine[k].sizes[0]) if b.sizes else (0, 1)
            at = b.offsets[0] if b.sizes else 0
            want_digests[(k, b.offsets)] = tuple(
                d for i, d in enumerate(_digests(w, k, b))
                if any(lo <= at + r < hi for r in range(i * _rows(b), min((i + 1) * _rows(b), n))))
        got_digests = {(k, c.offsets): tuple(c.digest(i) for i in range(*(c.blocks or (0, c.n_blocks))))
                       for k in mine for c in part.tensors[k].chunks}
        assert got_digests == want_digests and digest_bytes == 32 * sum(map(len, want_digests.values()))
        assert set(part.optimizer_steps) == {k.split(".", 2)[2] for k in mine if k.startswith("optim.")}
        partial.append((sum(len(d) for _, _, d in st.ranges), sum(sizes[index_name(w, sh)] for w, sh in wanted)))
    assert any(got < whole for got, whole in partial)  # some rank needs only part of an index it reads


def test_tools_read_keyed_and_whole_indexes_alike(tmp_path):
    top, _ = save(tmp_path, Layout.parse("dp_shard=2,tp=2"))
    every = [(r, s) for r in range(top.indexes) for s in (False, True)]
    keyed, problems = read_indexes(LocalStorage(str(tmp_path)), str(tmp_path), top, every, optional_shared=True)
    assert problems == []
    for ix in keyed:  # rewritten as one JSON document, as before indexes were keyed
        (tmp_path / index_name(ix.rank, ix.shared)).write_bytes(ix.to_bytes())
    whole, problems = read_indexes(LocalStorage(str(tmp_path)), str(tmp_path), top, every, optional_shared=True)
    assert problems == [] and [(i.rank, i.chunks) for i in whole] == [(i.rank, i.chunks) for i in keyed]
    merged, more = top.merged(keyed, whole=True)
    assert more == [] and merged.structure_problems() == []
    # A rank that meets one key of a whole-JSON index reads it whole, and gets every chunk of it.
    st = CountingStorage(str(tmp_path))
    (one,), problems = read_indexes(st, str(tmp_path), top, {(1, False): {"model.output.weight"}})
    assert problems == [] and st.whole == [index_name(1, False)]
    assert one.chunks == next(i.chunks for i in whole if (i.rank, i.shared) == (1, False))


def _damage(path, fix_crc: bool, edit) -> None:
    data = path.read_bytes()
    n = json.loads(data[:PREAMBLE_BYTES])["header_bytes"]
    head = edit(data[PREAMBLE_BYTES:PREAMBLE_BYTES + n])
    pre = data[:PREAMBLE_BYTES]
    if fix_crc:  # a header rewritten consistently (a writer bug, a forgery): the table itself is wrong
        import zlib
        pre = json.dumps({"format": "elastron-checkpoint-index", "format_version": KEYED_INDEX_VERSION, "header_bytes": len(head),
                          "header_crc32": zlib.crc32(head)}, separators=(",", ":")).ljust(PREAMBLE_BYTES - 1).encode() + b"\n"
    path.write_bytes(pre + head + data[PREAMBLE_BYTES + n:])


def _shift_table(head: bytes) -> bytes:
    d = json.loads(head)
    first, second = [i for i, x in enumerate(d["table"]) if x > 0][:2]
    d["table"][first] += 3  # the first record said 3 bytes longer, the next 3 shorter: same total size
    d["table"][second] -= 3
    return json.dumps(d, separators=(",", ":")).encode() + b"\n"


@pytest.mark.parametrize("fix_crc,edit,says", [
    (False, lambda h: h.replace(b'"table":[', b'"table":[9', 1), "fails its crc32"),
    (True, _shift_table, "is not a JSON object"),
    (True, lambda h: h.replace(b'"table":[', b'"table":[-1,', 1), "key table spans"),
    (True, lambda h: h.replace(b'"table":[', b'"table":["x",', 1), "key table of non-zero integers"),
])
def test_a_damaged_key_table_is_a_checkpoint_error_naming_the_file(tmp_path, fix_crc, edit, says):
    top, _ = save(tmp_path, Layout.parse("dp_shard=2,tp=2"))
    _damage(tmp_path / index_name(1), fix_crc, edit)
    keys = key_order(top.tensors)
    with pytest.raises(ManifestError, match=f"^index-r00001.json.*{says}") as e:
        Index.from_bytes((tmp_path / index_name(1)).read_bytes(), rank=1, step=5, keys=keys)
    assert isinstance(e.value, CheckpointError)
    # What a loading rank meets: one problem naming the file (the loader skips the checkpoint on it).
    _, problems = read_indexes(LocalStorage(str(tmp_path)), str(tmp_path), top,
                               {(0, False): {"model.output.weight"}, (1, False): set(keys)})
    assert len(problems) == 1 and problems[0].startswith("index-r00001.json") and says in problems[0]


def test_a_truncated_keyed_index_says_so(tmp_path):
    top, _ = save(tmp_path, Layout.parse("dp_shard=2,tp=2"))
    path = tmp_path / index_name(0)
    path.write_bytes(path.read_bytes()[:-10])
    _, problems = read_indexes(LocalStorage(str(tmp_path)), str(tmp_path), top, {(0, False): set(top.tensors)})
    assert len(problems) == 1 and "index-r00000.json ends inside the block digests" in problems[0]
    _, problems = read_indexes(LocalStorage(str(tmp_path)), str(tmp_path), top, [(0, False)])
    assert len(problems) == 1 and "index-r00000.json is" in problems[0] and "truncated" in problems[0]


def test_object_store_reads_take_exactly_the_ranges_asked(tmp_path):
    from parallel.checkpoint.storage import FsspecStorage

    top, _ = save(tmp_path, Layout.parse("dp_shard=2,tp=2"))
    st = FsspecStorage("memory://keyed-index-test")
    data = (tmp_path / index_name(1)).read_bytes()
    st.write_bytes(st.join(st.root, index_name(1)), data)
    try:
        assert st.read_ranges(st.join(st.root, index_name(1)), [(0, 7), (100, 5), (len(data) - 2, 9)]) == [
            data[:7], data[100:105], data[-2:]]
        (one,), problems = read_indexes(st, st.root, top, {(1, False): {"model.output.weight"}})
        assert problems == [] and list(one.chunks) == ["model.output.weight"]
    finally:
        st.remove_tree(st.root)


def test_a_digest_gap_merges_digest_ranges_alone_and_reads_the_same_digests(tmp_path):
    top, _ = save(tmp_path, Layout.parse("dp_shard=8"))
    bm = top.placement_of().boxmap(top.optimizer_states())
    mine = Placement(layout=Layout.parse("dp_shard=6"), n_layers=3, params=PARAMS).boxmap(STATES).held(1)
    wanted = index_keys_for(bm, mine)
    boxes = {k: (b.offsets, b.sizes) for k, b in mine.items()}
    reads = {}
    for gap in (0, 1 << 20):
        st = CountingStorage(str(tmp_path))
        indexes, problems = read_indexes(st, str(tmp_path), top, wanted, boxes=boxes, digest_gap=gap)
        assert problems == []
        kinds = Counter((n, "head" if a <= PREAMBLE_BYTES else "records" if data.endswith(b"\n") else "digests")
                        for n, a, data in st.ranges)
        reads[gap] = ([ix.chunks for ix in indexes], kinds)
    (chunks0, kinds0), (chunks1, kinds1) = reads[0], reads[1 << 20]
    assert chunks0 == chunks1  # the same digests of the same blocks, the bytes between dropped
    names = {n for n, _ in kinds0}
    assert all(kinds1[(n, "records")] == kinds0[(n, "records")] for n in names)  # records: as before
    assert all(kinds1[(n, "digests")] <= 1 for n in names)
    assert sum(kinds0[(n, "digests")] for n in names) > len(names)  # there was something to merge

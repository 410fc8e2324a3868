"""The checkpoint manifest: the model of what a checkpoint directory holds (`Manifest`), and its JSON
document, which makes the directory self-describing.

``manifest.json``, written last (its presence is the commit marker), holds the step, all non-tensor
state (layout, LR schedule, data position, RNG states, ...) and the global shape and dtype of every
tensor; the load path never unpickles. Format 4 (written now) lays it out in sections read by byte range
(`sections.py`); each rank of the save writes its own index before it (`index.py`), and a loading rank
reads the records of the indexes whose tiles meet its boxes (`placement.index_keys_for`) and merges
them (`merged`), then `coverage_problems` checks that they tile its boxes; tools read them all and check
the whole (`structure_problems`, `checks.py`). A checkpoint saved without a placement (a model `BoxMap`
cannot place) has one too, `null`: its loaders read every index whole.

The older formats, still read, are this document as one JSON object (`to_dict`, `from_dict`). Format 3:
the same indexes, and a top manifest holding every parameter, read whole by every rank. Format 2: one
manifest naming every chunk of every rank with its block digests. Checksums (formats 2-4): each file
records its algorithm and the digest of its header; each chunk records the digests of its row blocks
(`block_rows` rows of the chunk each, the last one shorter). Together they cover every byte of the file,
and a rank that needs only some rows of a chunk (a resharding load) reads and verifies only the blocks
holding them. Format 1 had one sha256 per whole file.

Pure: no torch import, so `inspect` and the CLI can read manifests cheaply.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from parallel.checkpoint import checks
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry, parse_file, parse_tensor
from parallel.checkpoint.errors import ManifestError
from parallel.checkpoint.fields import int_field, load_json, step_counters
from parallel.checkpoint.formats import FORMAT, FORMAT_VERSION, MANIFEST_NAME, PREAMBLE_BYTES, SECTIONED_VERSIONS, WHOLE_FORMAT
from parallel.checkpoint.index import Index
from parallel.checkpoint.keys import MODEL_PREFIX, OPTIM_PREFIX, KeyOrder, key_order, spell_keys
from parallel.checkpoint.sections import Sections, encode, manifest_header_size, parse_header, read_sections, split

_FIELDS = ("format", "format_version", "step", "created", "optimizer", "tensors", "files", "placement", "indexes",
           "params", "header_bytes", "header_crc32", "header", "sections", "parameters", "keys", "keys_crc32")


@dataclass(kw_only=True, slots=True)
class Manifest:
    """What a checkpoint directory holds: its step, its tensors' global shapes and dtypes (and, once its
    indexes are merged in, their chunks and files), the optimizer's step counters and all other state."""

    step: int
    """Optimizer steps completed when the checkpoint was taken."""
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    optimizer_steps: dict[str, int] = field(default_factory=dict)
    """AdamW's per-parameter step counters by canonical name. Kept out of the tensor files: DCP's
    consolidation writes 0-d tensors as zero (FACTS.md), and an integer needs no tensor. Formats 3-4 keep
    them in the indexes: a merged manifest has those of the indexes read."""
    optimizer_name: str = "AdamW"
    state: dict[str, Any] = field(default_factory=dict)
    """All other non-tensor state (layout, model_config, job_config_digest, lr_schedule, data, rng, ...),
    stored as top-level keys of the JSON document."""
    format_version: int = WHOLE_FORMAT
    created: float = field(default_factory=time.time)
    placement: dict[str, Any] | None = None
    """Formats 3-4: the layout the checkpoint was saved under (`placement.Placement.to_dict`), None when
    the save could not place its boxes by it (then every index is read)."""
    indexes: int = 0
    """Formats 3-4: the number of index files (``index-r00000.json`` ...), one per saving rank."""
    scope: str = "whole"
    """What the chunks and files cover: ``whole`` (formats 1-2, or format 3-4 with every index merged),
    ``top`` (a format-3-4 top manifest alone: no chunks), ``part`` (some indexes merged)."""
    sections: Sections | None = None
    """Format 4 as read: its sections, and which of them `tensors` holds (None: formats 1-3, or a
    manifest built in memory, whose tensors are all there)."""

    def __post_init__(self) -> None:
        clash = sorted(set(self.state) & set(_FIELDS))
        if clash:
            raise ValueError(f"manifest state keys {clash} collide with reserved manifest fields")

    # -- views -------------------------------------------------------------------------------------
    @property
    def layout(self) -> dict | None:
        return self.state.get("layout")

    def model_tensors(self) -> dict[str, TensorEntry]:
        """Model parameters by canonical name."""
        n = len(MODEL_PREFIX)
        return {k[n:]: v for k, v in self.tensors.items() if k.startswith(MODEL_PREFIX)}

    def optimizer_states(self) -> tuple[str, ...]:
        """The optimizer state names the tensors hold (``optim.<state>.<name>``), sorted."""
        return tuple(sorted({k[len(OPTIM_PREFIX):].split(".", 1)[0] for k in self.tensors
                             if k.startswith(OPTIM_PREFIX)}))

    def placement_of(self):
        """The `placement.Placement` of a format-3-4 manifest (None without one)."""
        from parallel.checkpoint.placement import Placement

        if self.placement is None:
            return None
        params = {n: (tuple(t.shape), t.dtype) for n, t in self.model_tensors().items()}
        return Placement.from_dict(self.placement, params)

    def section_rule(self):
        """(How many sections a format-4 top manifest has, parameter name -> the section holding it, or
        None where no section can): by the saved placement's pipeline stages, one section without it."""
        placement = self.placement_of()
        if placement is None:
            return 1, lambda name: 0
        return placement.n_sections, placement.section

    def sections_for(self, names) -> set[int]:
        """The sections of a format-4 manifest that hold the parameters `names` (canonical names)."""
        _, section = self.section_rule()
        return {i for n in names if (i := section(n)) is not None}

    def keys_in_order(self) -> "list[str] | KeyOrder":
        """The checkpoint's keys in the order keyed indexes list them (`key_order`); a format-4 manifest
        with some of its sections read: a `KeyOrder` of the keys of those."""
        sec = self.sections
        if sec is None or sec.complete:
            return key_order(self.tensors)
        return KeyOrder(sec.keys, sec.keys_crc32, {p: k for k, p in sec.positions.items()})

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        head = {"format": FORMAT, "format_version": self.format_version, "step": self.step, "created": self.created,
                **self.state}
        if self.format_version >= 3:  # the top manifest: no chunks, no files (they are in the indexes)
            params, states = self.model_tensors(), self.optimizer_states()
            spelled = {f"{p}{n}": (t.shape, t.dtype) for n, t in params.items()
                       for p in (MODEL_PREFIX, *(f"{OPTIM_PREFIX}{st}." for st in states))}
            if spelled == {k: (t.shape, t.dtype) for k, t in self.tensors.items()}:
                # Every parameter with the same optimizer states (AdamW's moments take its shape and
                # dtype): the parameters and the state names say it, a third of the bytes.
                tensors = {"params": {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in sorted(params.items())}}
            else:
                tensors = {"tensors": {k: {"shape": list(t.shape), "dtype": t.dtype} for k, t in sorted(self.tensors.items())}}
                states = ()
            return {**head, "optimizer": {"name": self.optimizer_name, "states": list(states)},
                    "placement": self.placement, "indexes": self.indexes, **tensors}
        return {
            **head,
            "optimizer": {"name": self.optimizer_name, "steps": dict(sorted(self.optimizer_steps.items()))},
            "tensors": {
                k: {"shape": list(t.shape), "dtype": t.dtype,
                    "chunks": [c.to_dict() for c in t.chunks]}
                for k, t in sorted(self.tensors.items())
            },
            "files": {k: f.to_dict() for k, f in sorted(self.files.items())},
        }

    def to_json(self) -> str:
        if self.format_version in SECTIONED_VERSIONS:
            return encode(self.to_dict(), tensors=self.tensors, parameters=len(self.model_tensors()),
                          rule=self.section_rule()).decode()
        if self.format_version >= 3:  # read by every rank on every load: no indentation
            return json.dumps(self.to_dict(), separators=(",", ":"))
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        """Parse and type-check a manifest; raises ManifestError saying what is wrong. The text may come
        from untrusted storage, so every field is checked rather than trusted. Format 4: the whole file
        (every section read), or its preamble and header alone (no section read: add them with
        `with_sections`)."""
        raw = text.encode() if isinstance(text, str) else text
        size = manifest_header_size(raw[:PREAMBLE_BYTES])
        if size is None:
            return cls.from_dict(load_json(text, "manifest"))
        n, crc, version = size
        head = cls.from_header(raw[PREAMBLE_BYTES:PREAMBLE_BYTES + n], crc, version)
        if len(raw) == PREAMBLE_BYTES + n:
            return head
        return head.with_sections(split(raw, head.sections))

    @classmethod
    def from_header(cls, data: bytes, crc: int, version: int) -> "Manifest":
        """A format-4 top manifest from its header bytes (after the preamble, whose `crc` they must
        match): everything but the parameters, which its sections hold (none read yet)."""
        d, sections = parse_header(data, crc, version)
        m = cls.from_dict(d)
        need = m.section_rule()[0]
        if len(sections.spans) != need:
            raise ManifestError(f"{MANIFEST_NAME} has {len(sections.spans)} section(s); its placement makes {need} "
                                "(corrupted)")
        m.sections = sections
        return m

    def with_sections(self, raw: dict[int, bytes]) -> "Manifest":
        """This format-4 manifest with the tensors of the sections `raw` (section number -> its bytes)
        added; raises ManifestError for a section that is truncated, fails its crc32 or is malformed.
        Once every section is in, the keys must be the ones the header counts."""
        if self.sections is None:
            raise ValueError("only a format-4 manifest has sections")
        tensors, sections = read_sections(self.sections, self.tensors, raw)
        return replace(self, tensors=tensors, sections=sections)

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ManifestError(f"manifest format is {d.get('format')!r}, expected {FORMAT!r}")
        version = int_field(d, "format_version")
        if version > FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {version} is newer than this code reads ({FORMAT_VERSION})")
        opt = d.get("optimizer", {})
        if not isinstance(opt, dict):
            raise ManifestError("manifest optimizer must be an object")
        steps = step_counters(opt.get("steps", {}), "manifest optimizer.steps")
        tensors_d = d.get("tensors")
        if version >= 3 and "params" in d:
            tensors_d = spell_keys(d["params"], opt.get("states", []))
        files_d = d.get("files", {} if version >= 3 else None)
        if not isinstance(tensors_d, dict) or not isinstance(files_d, dict):
            raise ManifestError("manifest needs 'tensors' and 'files' objects")
        tensors = {str(k): parse_tensor(k, v, chunks=version < 3) for k, v in tensors_d.items()}
        files = {str(k): parse_file(k, v) for k, v in files_d.items()}
        created = d.get("created", 0.0)
        m = cls(
            step=int_field(d, "step"),
            tensors=tensors,
            files=files,
            optimizer_steps=steps,
            optimizer_name=str(opt.get("name", "AdamW")),
            state={k: v for k, v in d.items() if k not in _FIELDS},
            format_version=version,
            created=float(created) if isinstance(created, (int, float)) else 0.0,
        )
        if version >= 3:
            m.indexes, m.placement, m.scope = int_field(d, "indexes"), d.get("placement"), "top"
            if m.indexes < 1:
                raise ManifestError("manifest indexes must be at least 1 (one index file per saving rank)")
            try:
                m.placement_of()
            except ValueError as e:
                raise ManifestError(f"manifest placement is malformed: {e}") from None
        return m

    def merged(self, indexes: list["Index"], *, whole: bool) -> tuple["Manifest", list[str]]:
        """(This top manifest with the chunks, files and step counters of `indexes`, problems found on
        the way). `whole`: every index of the checkpoint is among them (then `structure_problems` checks
        the whole); else the result covers only what those indexes describe (`coverage_problems`)."""
        chunks: dict[str, list[Chunk]] = {k: [] for k in self.tensors}
        files: dict[str, FileEntry] = {}
        steps: dict[str, int] = {}
        problems: list[str] = []
        for ix in indexes:
            problems += ix.problems(self.tensors)
            files.update(ix.files)
            for key, c in ix.chunks.items():
                if key in chunks:
                    chunks[key].append(c)
            for p, n in ix.optimizer_steps.items():
                if steps.setdefault(p, n) != n:
                    problems.append(f"indexes disagree on the optimizer step of {p}: {steps[p]} vs {n}")
        tensors = {k: TensorEntry(shape=t.shape, dtype=t.dtype, chunks=tuple(sorted(chunks[k], key=lambda c: c.offsets)))
                   for k, t in self.tensors.items()}
        out = Manifest(step=self.step, tensors=tensors, files=files, optimizer_steps=steps,
                       optimizer_name=self.optimizer_name, state=self.state, format_version=self.format_version,
                       created=self.created, placement=self.placement, indexes=self.indexes,
                       scope="whole" if whole else "part", sections=self.sections)
        return out, problems

    # -- checks ------------------------------------------------------------------------------------
    def structure_problems(self) -> list[str]:
        """Chunks that fall outside their tensor, overlap, leave holes, or name unlisted files; files
        too small for the chunks they are said to hold (so a forged manifest cannot make a loader
        allocate more than the checkpoint's size). A format-3-4 top manifest alone (scope ``top``) has
        no chunks: only its dtypes are checked (`coverage_problems` checks a rank's part, once read)."""
        if self.scope != "whole":
            return checks.dtype_problems(self.tensors)
        return checks.structure_problems(self.tensors, self.files)

    def coverage_problems(self, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
        """Whether the chunks merged in (scope ``part``) tile each of `boxes` (key -> (offsets, sizes) a
        rank loads) exactly: what one rank checks of a format-3-4 checkpoint before reading; the ranks'
        boxes together cover every tensor. Also that every parameter whose moments it loads has its
        step counter. The chunks' own fit and checksums were checked per index (`Index.problems`)."""
        return checks.coverage_problems(self.tensors, self.optimizer_steps, boxes)

    def model_problems(self, expected: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
        """Differences between the checkpoint's model tensors and the model about to receive them
        (`expected`: canonical name -> (global shape, dtype name)). Shape mismatches come first: they show
        both shapes, the clearest sign of a different model when only the first problem is shown. A
        format-4 manifest with some sections read compares the parameters of those sections (and the
        number of parameters in all)."""
        sec = self.sections
        if sec is not None and not sec.complete:
            _, section = self.section_rule()
            return checks.model_problems(self.model_tensors(), expected, parameters=sec.parameters,
                                         held=lambda n: (i := section(n)) is None or i in sec.read)
        return checks.model_problems(self.model_tensors(), expected)

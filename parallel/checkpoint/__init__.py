"""Layout-agnostic checkpoints: save under one (dp_replicate, dp_shard, tp, pp) layout, load under any.

On disk, one directory per step under the checkpoints root::

    checkpoints/
      latest                      "step-00000020" (moved only after a commit)
      step-00000010/
        shard-r00000-00.safetensors   one or more files per rank that writes data (writer.py)
        index-r00000.json         each rank's files, chunks and block digests (formats 3-4, index.py),
                                  keyed: a header says where each key's record lies
        index-r00000-shared.json  the same for boxes held beyond their replicas, by the ranks that write any
        ...
        manifest.json             written last: the commit marker (manifest.py; format 4: sections.py)
      step-00000020/

Modules: manifest (the `Manifest` model and its JSON document), sections (format 4's byte layout of
manifest.json), index (a saving rank's index, keyed or whole), entries (chunk, tensor and file records),
keys (tensor keys and their order), repeats (runs of identical layers written once), checks (fit,
overlap, coverage and model checks), formats (tags, versions, file names, the preamble), fields (checked
reading of untrusted JSON) and errors: all pure; placement (who writes each box, which indexes a rank
reads: pure), storage (local/fsspec file operations and commit), tensor_io (pickle-free safetensors
reading; DCP StorageReader over the manifest), validate (which checkpoints exist and whether one is
loadable), state (model/optimizer <-> flat tensor dict, staging, RNG), manager (CheckpointManager: async
save, commit, retention, load with fallback), offline (inspect and load_full_model_state without a
process group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parallel.checkpoint.errors import CheckpointError, ManifestError
from parallel.checkpoint.formats import FORMAT_VERSION, MANIFEST_NAME
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.offline import inspect, load_full_model_state

if TYPE_CHECKING:  # pragma: no cover
    from parallel.checkpoint.manager import CheckpointManager

__all__ = [
    "FORMAT_VERSION", "MANIFEST_NAME", "CheckpointError", "CheckpointManager", "Manifest", "ManifestError",
    "inspect", "load_full_model_state",
]


def __getattr__(name: str) -> Any:
    # The manager pulls in torch.distributed.checkpoint; tools that only inspect do not need it.
    if name == "CheckpointManager":
        from parallel.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The DCP storage writer for checkpoint shards."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import HuggingFaceStorageWriter


class ShardWriter(HuggingFaceStorageWriter):
    """DCP's HuggingFace safetensors writer in distributed mode (one file per rank, no consolidation,
    no index file), recording the names of the files this rank wrote."""

    def __init__(self, path: str, *, fsspec_options: dict[str, Any] | None = None, sync_files: bool = True):
        super().__init__(path=path, save_distributed=True, enable_consolidation=False)
        self.sync_files = sync_files
        if fsspec_options is not None:
            from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

            self.fs = FsspecFileSystem()
            self.path = self.fs.init_path(path, **fsspec_options)
        self.written: list[str] = []

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self.written = sorted({wr.storage_data.relative_path for wr in fut.value()})
        return fut

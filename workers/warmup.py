"""One-time process costs paid before they are needed: what a standby worker runs while it waits.

The first training step of a process pays for more than its arithmetic: importing torch's compiler stack
(any optimizer step, and every op on the meta device, import torch._dynamo), the modules that register
DTensor, FSDP2 and pipelining ops, the CUDA context, and on GPUs the lazy loading of each kernel on its
first launch. `warm_up` pays all of them in the current process by running one real training step of a
tiny model through the production path (the `Trainer`, on a private single-rank process group that it
tears down after), so a standby worker that is later given a rank starts at the speed of a warm one. With
`cache_key` (`workers.compile_cache.job_cache_key`) it also points torch.compile's caches at the job's node-local directory
(`workers.compile_cache`), so a compiled job's workers reuse each other's graphs.

    from workers.warmup import warm_up
    took = warm_up("cpu", cache_key=job_cache_key(cfg.name, run_dir))   # what `Worker.warm_up` runs
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workers.compile_cache import apply_compile_cache
from workers.report import Warmed

PHASES = ("import", "cuda_context", "first_step")
"""The phases `Warmed.to_dict` names."""


def warm_up(device: str | torch.device = "auto", *, cache_key: str | None = None) -> Warmed:
    """Pay the process's one-time costs now; returns the seconds each phase took. Refuses to run
    inside a process group (a worker that already has a rank is warm by definition)."""
    if dist.is_initialized():
        raise RuntimeError("warm_up runs before the worker joins a process group, not after")
    t = time.perf_counter()
    if cache_key is not None:
        apply_compile_cache(cache_key)
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    from workers.runtime import pick_device
    from workers.trainer import Trainer  # noqa: F401 (and everything it imports)

    import_s = time.perf_counter() - t
    t = time.perf_counter()
    dev = pick_device(str(device)) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        torch.cuda.init()
        torch.ones(1, device=dev).sum().item()  # the context and the caching allocator
    cuda_context_s = time.perf_counter() - t
    t = time.perf_counter()
    _one_tiny_step(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return Warmed(import_s=import_s, cuda_context_s=cuda_context_s, first_step_s=time.perf_counter() - t)


def _one_tiny_step(device: torch.device) -> None:
    """One step of the `tiny` preset through the Trainer on a private single-rank group."""
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = JobConfig.from_dict({
            "name": "warm-up",
            "model": {"preset": "tiny", "overrides": {"n_layers": 1}},
            "data": {"source": "synthetic", "seq_len": 16},
            "train": {"steps": 1, "global_batch_size": 1, "micro_batch_size": 1,
                      "dtype": "bfloat16" if device.type == "cuda" else "float32"},
        })
        trainer = Trainer(cfg, layout=Layout.parse("dp=1"), device=device).build(resume=False)
        trainer.train_step()
        trainer.close()
    finally:
        from workers.runtime import destroy_process_group

        destroy_process_group()  # and the warm-up's mesh with it (`workers.runtime.forget_meshes`)

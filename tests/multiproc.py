"""Run a function on N ranks joined by one process group (test tier 2): gloo on CPU by default, or
NCCL with one GPU per rank when ELASTRON_TEST_DEVICE=cuda (scripts/gpu_check.sh on a multi-GPU machine).

    results = run_ranks(4, tests.bodies.train_body, cfg, "dp=2,tp=2")

Bodies take their device from `rank_device()` and the test's backend from `ranks_device_type()`, so the
same test file runs on gloo/CPU in CI and on NCCL/CUDA; a layout needing more ranks than there are GPUs
is skipped there.

Ranks are forked from a forkserver that imported torch and the trainer once (`PRELOAD`): a spawned
process re-imported them for every rank of every test, 2-5 s each on a 2-core box. The forkserver is a
clean process (it has run nothing, holds one thread and no CUDA context), so each rank still starts from
pristine module state, and gets the caller's environment at the call (not the server's). `spawn=True`
starts each rank as a new interpreter instead, for benchmarks that time what a fresh process pays.
`fn` must be importable by its module name (each child imports it), so rank bodies live in
ordinary modules such as tests/bodies.py rather than in test files. Each child gets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT and OMP_NUM_THREADS=1, and the default process group is initialised before
`fn` runs and destroyed after. A failure in any rank raises with that rank's traceback; a hang is killed
after `timeout` seconds, and reported with each rank's exit code (a rank that died without a word
leaves the others waiting for it) and, 5 s before, every rank's Python stacks on stderr.
"""

from __future__ import annotations

import os
import queue
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from tests.ports import free_port

DEVICE_ENV = "ELASTRON_TEST_DEVICE"
"""cpu (default) or cuda: where spawned ranks compute, and so which backend joins them (gloo or NCCL)."""


def ranks_device_type() -> str:
    """"cuda" when ELASTRON_TEST_DEVICE asks for it and CUDA is there, else "cpu"; a request for CUDA
    without a GPU is an error rather than a silent CPU run."""
    want = os.environ.get(DEVICE_ENV, "cpu").strip().lower() or "cpu"
    if want not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={want!r}: expected cpu or cuda")
    if want == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"{DEVICE_ENV}=cuda but no CUDA device is visible; unset it to test on CPU")
    return want




def rank_device():
    """This rank's device: cuda:LOCAL_RANK under ELASTRON_TEST_DEVICE=cuda, else the CPU."""
    import torch

    if ranks_device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend() -> str:
    """The backend collectives on `rank_device()` tensors go through: nccl or gloo."""
    return "nccl" if ranks_device_type() == "cuda" else "gloo"


def _to_wire(x: Any) -> Any:
    """Tensors as numpy arrays: torch's queue pickler would pass shared-memory handles that die with the
    child process."""
    import torch

    if isinstance(x, torch.Tensor):
        return ("__tensor__", x.detach().cpu().numpy())
    if isinstance(x, dict):
        return {k: _to_wire(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_wire(v) for v in x)
    return x


def _from_wire(x: Any) -> Any:
    import torch

    if isinstance(x, tuple) and len(x) == 2 and x[0] == "__tensor__":
        return torch.from_numpy(x[1])
    if isinstance(x, dict):
        return {k: _from_wire(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_from_wire(v) for v in x)
    return x


PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor", "workers.trainer"]
"""Imported once by the forkserver the ranks are forked from (all of them leave it single-threaded)."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server first starts
    return ctx


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, q,
           stacks_after: float | None = None, env: dict[str, str] | None = None) -> None:
    if env is not None:  # the caller's environment now, not the forkserver's from when it started
        os.environ.clear()
        os.environ.update(env)
    if stacks_after is not None:  # a hang shows where each rank is, in the test's captured stderr
        import faulthandler

        faulthandler.dump_traceback_later(stacks_after, exit=False)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        from workers.runtime import destroy_process_group, init_process_group

        device = rank_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_process_group(device, timeout_s=120)
        try:
            result = fn(*args, **kwargs)
        finally:
            destroy_process_group()
        q.put((rank, True, _to_wire(result)))
    except BaseException:  # report every failure, including KeyboardInterrupt in a child
        q.put((rank, False, traceback.format_exc()))


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 240.0, spawn: bool = False,
              **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the results ordered by rank. On CUDA, a
    world larger than the GPUs here skips the calling test.

    The rendezvous port is picked free and released before rank 0 binds it, so another process can
    take it in between (EADDRINUSE); only that error relaunches, on a new port, up to 3 times."""
    if ranks_device_type() == "cuda":
        import pytest
        import torch

        if world_size > torch.cuda.device_count():
            pytest.skip(f"{world_size} ranks need {world_size} GPUs, {torch.cuda.device_count()} here")
    for attempt in range(3):
        try:
            return _run_once(world_size, fn, args, kwargs, timeout, spawn)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_once(world_size: int, fn: Callable, args: tuple, kwargs: dict, timeout: float, spawn: bool) -> list[Any]:
    ctx = mp.get_context("spawn") if spawn else _context()
    q = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, kwargs, q, max(1.0, timeout - 5), env),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"{world_size - len(results) - len(errors)} rank(s) gave no result within {timeout:.0f}s "
                    f"(exit codes by rank, None = still running: {[p.exitcode for p in procs]}; each rank's "
                    "Python stacks are in the captured stderr)"
                    + "".join(f"\n--- rank {r} ---\n{e}" for r, e in errors.items())
                ) from None
            (results if ok else errors)[rank] = payload
            if errors:
                # One failed rank usually leaves the others blocked in a collective: stop waiting.
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("".join(f"\n--- rank {r} failed ---\n{e}" for r, e in sorted(errors.items())))
    return [_from_wire(results[r]) for r in range(world_size)]

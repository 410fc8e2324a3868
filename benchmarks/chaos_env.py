"""What a chaos run acts on: a `ray.cluster_utils.Cluster` of 1-CPU worker nodes (the head takes no
workers, so removing nodes never removes the coordinator), the job API as a separate process, and the
processes behind them (found by their Ray process titles, so no state API is needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from service.pool.cluster import kill_node
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def wait(cond, timeout: float, what: str, interval: float = 0.05):
    """cond()'s first truthy value, or TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _title(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
        return cmd[0] if cmd else ""
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


class ChaosEnv:
    """Start with `start()`, end with `close()` (also on errors: it removes everything it started)."""

    def __init__(self, workdir: Path, *, nodes: int = 3, log=print, server_args: tuple[str, ...] = ()):
        """`server_args`: extra arguments of benchmarks/chaos_server.py."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)  # a --workdir that does not exist yet
        self.server_args = tuple(server_args)
        self.target_nodes = nodes
        self.log = log
        self.cluster = None
        self.nodes: list = []
        self.api_proc: subprocess.Popen | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runs_root = self.workdir / "runs"
        self.store = f"sqlite:///{self.workdir / 'jobs.db'}"
        self._api_starts = 0

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> "ChaosEnv":
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.restore_nodes()
        self.start_api()
        return self

    def close(self) -> None:
        import ray

        self.stop_api()
        try:
            ray.shutdown()
        finally:
            if self.cluster is not None:
                self.cluster.shutdown()

    # -- nodes ---------------------------------------------------------------------------------------------
    def restore_nodes(self) -> int:
        """Add 1-CPU nodes until `target_nodes` are alive; returns how many were added."""
        alive = [n for n in self.nodes if n.remaining_processes_alive()]
        self.nodes = alive
        added = 0
        while len(self.nodes) < self.target_nodes:
            self.nodes.append(self.cluster.add_node(num_cpus=1))
            added += 1
        if added:
            self._wait_alive([n.node_id for n in self.nodes[-added:]])
        return added

    @staticmethod
    def _wait_alive(node_ids: list[str]) -> None:
        """Until Ray lists each of `node_ids` alive. Not `Cluster.wait_for_nodes()`, which waits until
        the GCS counts as many alive nodes as the cluster has, that is also until it has given up on a
        node removed without notice (~15 s of missed health checks): the job does not wait for that,
        and the chaos run should not either (it only gave the job time to train past its last step)."""
        import ray

        wait(lambda: set(node_ids) <= {n["NodeID"] for n in ray.nodes() if n.get("Alive")}, 60,
             f"{len(node_ids)} new node(s) to register")

    def raylet_pid(self, node) -> int:
        from ray._private import ray_constants

        return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid

    def workers_on(self, node, *, members: set[int] | None = None) -> list[int]:
        """Pids of training worker actors (process title ray::Worker...) under the node's raylet; with
        `members`, only those among them."""
        try:
            kids = psutil.Process(self.raylet_pid(node)).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p.pid for p in kids if _title(p).startswith("ray::Worker") and (members is None or p.pid in members)]

    def nodes_with_workers(self) -> list:
        members = self.member_pids()
        return [n for n in self.nodes if self.workers_on(n, members=members)]

    def worker_pids(self) -> list[int]:
        """The job's training workers: not its standbys, idle processes whose death is no fault of the job."""
        members = self.member_pids()
        return [pid for n in self.nodes for pid in self.workers_on(n, members=members)]

    @staticmethod
    def member_pids() -> set[int]:
        """Pids of the job's workers that hold a slot (a placement group: service.pool.worker_group), not its
        standbys. Quick, since victims are chosen inside a fault's timing: a worker still starting answers
        only once started (~2 s), so it is not waited for, nor chosen."""
        return {info.pid for info in ask_workers("info", timeout_s=0.5) if info.pg is not None}

    def remove_node(self, node) -> None:
        """The node dies as a machine does: its raylet, agents and workers at once (service.pool.cluster.kill_node)."""
        kill_node(self.cluster, node)
        self.nodes = [n for n in self.nodes if n is not node]

    # -- the API server ------------------------------------------------------------------------------------
    def start_api(self) -> None:
        self._api_starts += 1
        log = open(self.workdir / f"api-{self._api_starts}.log", "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.api_proc = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "chaos_server.py"), "--address", self.cluster.address,
             "--port", str(self.port), "--runs-root", str(self.runs_root), "--store", self.store,
             *self.server_args],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(self.workdir), start_new_session=True)
        log.close()

        def up():
            if self.api_proc.poll() is not None:
                raise RuntimeError(f"the API server exited with {self.api_proc.returncode}; see "
                                   f"{self.workdir / f'api-{self._api_starts}.log'}")
            try:
                return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait(up, 120, "the API server to answer", interval=0.2)

    def stop_api(self, sig: int = signal.SIGKILL) -> None:
        if self.api_proc is not None and self.api_proc.poll() is None:
            os.kill(self.api_proc.pid, sig)
            self.api_proc.wait(30)
        self.api_proc = None

    def restart_api(self) -> float:
        """Kill the API process without warning and start a new one; returns seconds until it answered."""
        t0 = time.time()
        self.stop_api(signal.SIGKILL)
        self.start_api()
        return time.time() - t0


def ask_workers(method: str, *, timeout_s: float) -> list:
    """The answers of every worker actor of the cluster's jobs (named `elastron-worker-...`) to `method`,
    asked on its control lane (so a worker inside a step answers too), from those that answer within
    `timeout_s`; a worker that ends meanwhile is left out."""
    import ray

    asked = []
    for e in ray.util.list_named_actors(all_namespaces=True):
        if e["name"].startswith("elastron-worker-"):
            try:
                actor = ray.get_actor(e["name"], namespace=e["namespace"])
            except ValueError:  # ended meanwhile
                continue
            asked.append(getattr(actor, method).options(concurrency_group="control").remote())
    done, _ = ray.wait(asked, num_returns=len(asked), timeout=timeout_s)
    out = []
    for ref in done:
        try:
            out.append(ray.get(ref))
        except Exception:  # ended meanwhile
            continue
    return out

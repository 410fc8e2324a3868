"""A REST job's detached workers, found and released by name.

A coordinator that runs in a named actor Ray may restart (`CoordinatorOptions.owner`) starts its
workers as detached actors in detached placement groups, both named ``elastron-worker-{job_id}-{uid}``,
so that they outlive its process. Nothing then ends them with it: a worker ends itself once its
coordinator is gone for good (`workers.actor.watch_owner`, which also removes its placement group); a
worker that died while no coordinator watched leaves its placement group reserved, so a coordinator
that takes the job's workers over, and the launcher that deletes the job, sweep by name here.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

logger = logging.getLogger(__name__)


def worker_prefix(job_id: str) -> str:
    """Name prefix of a job's detached workers and of their placement groups."""
    return f"elastron-worker-{job_id}-"


STANDBY = "standby-"
"""After `worker_prefix`, the name of an actor started as a standby (service.pool.reserve.Reserve.keep_standby),
followed by its node's id (`standby_kind`); claimed as a member it keeps its name."""


def standby_kind(node_id: str) -> str:
    """The part of a standby's name after `worker_prefix`, before its unique suffix: it names the node the
    standby is pinned to, so a coordinator taking the job over knows it before the standby answers."""
    return f"{STANDBY}{node_id}-"


def standby_node(job_id: str, name: str) -> str | None:
    """The node a standby of `job_id` named `name` is pinned to (`standby_kind`); None for another name."""
    head = worker_prefix(job_id) + STANDBY
    if not name.startswith(head) or "-" not in name[len(head):]:
        return None
    return name[len(head):].rsplit("-", 1)[0] or None


def find_workers(job_id: str, namespace: str) -> list[tuple[str, object]]:
    """(name, handle) of the job's detached workers Ray lists as alive."""
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith(worker_prefix(job_id)):
            try:
                out.append((entry["name"], ray.get_actor(entry["name"], namespace=namespace)))
            except ValueError:  # ended since it was listed
                pass
    return out


def stray_groups(job_id: str, *, keep: Collection[str] = ()) -> list[PlacementGroup]:
    """The job's named placement groups still reserved, but those whose ids (hex) are in `keep`."""
    from ray._raylet import PlacementGroupID

    return [PlacementGroup(PlacementGroupID.from_hex(pg_id)) for pg_id, t in placement_group_table().items()
            if t.get("name", "").startswith(worker_prefix(job_id)) and t.get("state") != "REMOVED"
            and pg_id not in keep]


def release_workers(job_id: str, *, keep: Collection[str] = ()) -> int:
    """Remove the job's placement groups but those whose ids (hex) are in `keep`; removing one ends
    the worker in it. Returns how many were removed."""
    groups = stray_groups(job_id, keep=keep)
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:
            logger.debug("removal of a detached worker's placement group failed", exc_info=True)
    return len(groups)


def end_workers(job_id: str, namespace: str) -> None:
    """End every detached worker of the job and release its placement groups (the job is deleted). A
    claimed standby does not run in its placement group (`Worker.claim`), so removing that alone would
    leave it running until it noticed its coordinator gone."""
    for _, actor in find_workers(job_id, namespace):
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            logger.debug("kill of a detached worker failed", exc_info=True)
    release_workers(job_id)

"""A worker's slot: the placement group holding one worker's resources on its node, and the names the
group gives what it starts.

A group with an owner (a coordinator Ray may restart) names its actors and placement groups after the
job and makes them detached, so that they outlive that coordinator's process (`service.pool.detached`).
A member a salvage stopped on a node that lives leaves its slot placed ("vacant"): the next start on
that node takes it at once, where a new placement group would wait for the old one's removal to free
the node; the slots no start took are removed after it.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict

from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from service.pool.detached import worker_prefix
from service.pool.placement import on_node

__all__ = ["Slots", "remove_slot"]

logger = logging.getLogger(__name__)


def remove_slot(pg: PlacementGroup) -> None:
    """Remove a placement group; one already gone is fine."""
    try:
        remove_placement_group(pg)
    except Exception:
        logger.debug("placement group removal failed", exc_info=True)


class Slots:
    """The slots of one job's workers: `cpus` and `gpus` per worker; `owner` (None: the group's actors end
    with the process that started them) and `job_id` name them."""

    def __init__(self, *, cpus: float, gpus: float, job_id: str, owner: str | None):
        self.cpus, self.gpus, self.job_id, self.owner = cpus, gpus, job_id, owner
        self._vacant: dict[str, list[PlacementGroup]] = defaultdict(list)
        """Per node, the placement groups of members a salvage stopped there while the node lived: still
        placed, their resources free once the process is gone."""

    def named(self, kind: str = "") -> dict[str, str]:
        """Name and lifetime of a new actor or placement group: detached and named after the job when the
        group has an owner, so that they outlive its coordinator (`service.pool.detached`). `kind`: a name
        part after the job's prefix (`standby_kind`)."""
        if self.owner is None:
            return {}
        return {"name": f"{worker_prefix(self.job_id)}{kind}{uuid.uuid4().hex[:12]}", "lifetime": "detached"}

    def new(self, nid: str, *, node: dict | None = None, **named) -> PlacementGroup:
        """A placement group for one worker's resources, targeting node `nid` (softly; with `node`, its
        `ray.nodes()` row, pinned there by a sliver of its `node:IP` resource: `on_node`)."""
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **on_node(node)}
        return placement_group([bundle], strategy="STRICT_PACK", _soft_target_node_id=nid, **named)

    def leave_vacant(self, nid: str, pg: PlacementGroup) -> None:
        """Keep `pg`, the slot of a member stopped on the live node `nid`, for the next start there."""
        self._vacant[nid].append(pg)

    def take_vacant(self, nid: str) -> PlacementGroup | None:
        """A slot a stopped member left on node `nid`, if there is one."""
        return self._vacant[nid].pop() if self._vacant.get(nid) else None

    def release_vacant(self) -> None:
        """Remove the slots no start took: they hold resources the job is not using."""
        for pgs in self._vacant.values():
            for pg in pgs:
                remove_slot(pg)
        self._vacant.clear()

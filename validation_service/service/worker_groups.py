"""Sharded reports whose worker group ended: their missing parts never come.

A report of several ranks is an assembly keyed by its worker group (ReportCall.group_key:
``pg<Ray Train's placement group id>-<call>``). When Ray removes that placement group (the
run finished, failed, was preempted, or Ray Tune stopped its trial), every rank that could
still store a part or seal is gone: the scheduler ends such open assemblies INCOMPLETE at
once, rather than when the run is ended or after the assembly's lease. Only a placement
group that Ray reports REMOVED counts: one this cluster does not know (a run reporting from
another Ray cluster into the same registry) is left alone.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_PREFIX = "pg"  # trainer_integration._parts.worker_group


def placement_group_of(group_key: str) -> str | None:
    """The placement group id a sharded report's group key names, or None (torchrun)."""
    if not group_key.startswith(_PREFIX) or "-" not in group_key:
        return None
    return group_key[len(_PREFIX) :].rsplit("-", 1)[0] or None


def removed_placement_groups() -> set[str]:
    """The ids of the placement groups this Ray cluster reports REMOVED."""
    import ray.util

    table = ray.util.placement_group_table()
    return {pg_id for pg_id, info in table.items() if info.get("state") == "REMOVED"}


def end_reports_of_ended_groups(assemblies) -> int:
    """Ends INCOMPLETE the open assemblies whose worker group Ray removed; returns how
    many. A read first: nothing is written while no such assembly is open."""
    open_keys = assemblies.open_group_keys()
    groups = {aid: placement_group_of(key) for aid, key in open_keys.items()}
    groups = {aid: pg for aid, pg in groups.items() if pg is not None}
    if not groups:
        return 0
    removed = removed_placement_groups()
    gone = sorted(aid for aid, pg in groups.items() if pg in removed)
    ended = assemblies.give_up_ended_groups(gone)
    if ended:
        logger.info("ended %d sharded report(s) whose worker group ended as INCOMPLETE", ended)
    return ended

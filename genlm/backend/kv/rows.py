"""How a backend's runner orders a plan's rows (`genlm.backend.kv.store.BatchPlan.rows`):
it groups them by what one forward needs in common (`row_groups`), computes group after
group, and puts its batch back in the plan's order (`plan_order`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

Row = TypeVar("Row")


def row_groups(rows: Sequence[Row], key: Callable[[Row], Hashable]) -> list[list[int]]:
    """The positions of ``rows`` grouped by ``key``, groups in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(key(row), []).append(index)
    return list(groups.values())


def plan_order(groups: list[list[int]]) -> list[int] | None:
    """Where each row of a plan lies in a batch computed group after group (`row_groups`,
    each group's rows together, in the order of ``groups``): the rows to take, in the
    plan's order (None: one group, the usual step, already in order)."""
    if len(groups) == 1:
        return None
    order = [index for indices in groups for index in indices]
    inverse = [0] * len(order)
    for position, index in enumerate(order):
        inverse[index] = position
    return inverse

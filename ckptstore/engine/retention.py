"""How many committed steps each tier keeps."""

from __future__ import annotations

import logging

from ..errors import CheckpointError
from ..tiers.base import Tier

log = logging.getLogger("ckptstore")


class Retention:
    """Keep the newest ``keep`` committed steps of ``tier`` (None: all). Applied by the one rank
    that ``owns`` the tier's root (the lowest rank sharing a local directory, rank 0 for the durable
    tier), after each commit there: a step goes only once ``keep`` newer ones are committed in the
    same tier, so the newest step of a tier is never deleted."""

    def __init__(self, tier: Tier, keep: int | None, *, owner: bool) -> None:
        self.tier, self.keep, self.owner = tier, keep, owner

    async def apply(self, protect: frozenset[int] = frozenset()) -> None:
        if self.keep is None or not self.owner:
            return
        try:
            steps = await self.tier.steps()
            for step in steps[: -self.keep]:
                if step not in protect:
                    await self.tier.remove(step)
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore: retention in the %s tier failed (old steps are kept): %s", self.tier.name, exc)

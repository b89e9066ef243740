"""Stragglers: per-rank stage timings from a manifest, and the ranks far slower than the median."""

from __future__ import annotations

import statistics
from typing import Any

# Stage names as the manifests record them, in pipeline order, with what they measure.
STAGES = {
    "stage_s": "staging (copy into RAM)",
    "hash_s": "checksums of the staged copy",
    "plan_s": "planning (save_sharded)",
    "local_s": "local write",
    "write_s": "this tier's write",
    "replicate_s": "replication to peers",
    "promote_s": "durable write (promotion)",
}


def stage_table(ranks: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The stages any rank recorded (in pipeline order) and one row per rank."""
    seen = {k for r in ranks for k in r.get("timings", {})}
    stages = [s for s in STAGES if s in seen] + sorted(seen - set(STAGES))
    rows = [{"rank": r.get("rank"), "host": r.get("host", "?"), **{s: r.get("timings", {}).get(s) for s in stages}}
            for r in ranks]
    return stages, rows


def stragglers(ranks: list[dict[str, Any]], factor: float = 2.0, floor_s: float = 0.01) -> list[dict[str, Any]]:
    """Per stage, ranks over ``factor`` times the median of that stage (and over ``floor_s``, to ignore
    noise on fast stages); sorted by host, then rank."""
    stages, rows = stage_table(ranks)
    out = []
    for s in stages:
        values = [r[s] for r in rows if isinstance(r[s], (int, float))]
        if len(values) < 2:
            continue
        med = statistics.median(values)
        for r in rows:
            t = r[s]
            if isinstance(t, (int, float)) and t > floor_s and t > factor * med:
                out.append({"host": r["host"], "rank": r["rank"], "stage": s, "seconds": t, "median_s": med,
                            "ratio": t / med if med > 0 else float("inf")})
    return sorted(out, key=lambda x: (str(x["host"]), x["rank"], x["stage"]))

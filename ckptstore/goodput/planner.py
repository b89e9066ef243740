"""The checkpoint interval planner: pure functions of cost, MTBF and restart time (no I/O).

Symbols (all in seconds): ``cost`` (delta) is what one checkpoint blocks training for, ``mtbf`` (M)
the mean time between failures of the whole job, ``restart`` (R) the time from a failure to training
again (detection, rescheduling, loading), ``tau`` the compute time between two checkpoints.

- Young (1974): tau = sqrt(2 * delta * M), first order in delta / M.
- Daly (2006): tau = sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta for delta < 2M,
  else M; a higher-order fit to the optimum of the model below.
- The model itself (Daly's): failures are a Poisson process of rate 1/M, a failure during a segment
  (tau of compute + delta of checkpoint) loses the segment, and every failure costs a restart R during
  which another failure restarts the restart. The expected wall time of one segment is then
  ``M * exp(R/M) * (exp((tau + delta)/M) - 1)``, which splits exactly into the segment itself, the time of
  failed attempts (lost work) and the restarts; :func:`waste` returns that split.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import InvalidArgumentError

_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0,
          "d": 86400.0, "day": 86400.0, "days": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_duration(value: str | float | int, what: str = "duration") -> float:
    """Seconds from ``90``, ``"90s"``, ``"1.5m"``, ``"3h"``, ``"2d"``; an InvalidArgumentError otherwise."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be a duration such as 60, '60s', '20m' or '3h', not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value).lower())
        if m is None or m.group(2) not in _UNITS:
            raise InvalidArgumentError(
                f"{what} {value!r} is not a duration: use a number of seconds or a number with s, m, h or d (e.g. 20m)")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"{what} must be a finite non-negative duration, not {value!r}")
    return seconds


def human(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 172800:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} d"


def mtbf_from_rate(failures: float, over_s: float, on_gpus: float, gpus: float) -> float:
    """The job's MTBF when ``failures`` interruptions were seen over ``over_s`` seconds on ``on_gpus`` GPUs
    and the job runs on ``gpus``: failures scale with the number of GPUs (independent failures)."""
    if failures <= 0 or over_s <= 0 or on_gpus <= 0 or gpus <= 0:
        raise InvalidArgumentError("failures, the observation time and both GPU counts must be positive")
    per_gpu_s = failures / (over_s * on_gpus)
    return 1.0 / (per_gpu_s * gpus)


def _check(cost: float, mtbf: float) -> None:
    if not (cost > 0 and math.isfinite(cost)):
        raise InvalidArgumentError(f"the checkpoint cost must be positive, not {cost!r}")
    if not (mtbf > 0 and math.isfinite(mtbf)):
        raise InvalidArgumentError(f"the MTBF must be positive, not {mtbf!r}")


def young(cost: float, mtbf: float) -> float:
    """Young's interval sqrt(2 * cost * MTBF) (compute time between checkpoints)."""
    _check(cost, mtbf)
    return math.sqrt(2.0 * cost * mtbf)


def daly(cost: float, mtbf: float) -> float:
    """Daly's higher-order interval (compute time between checkpoints)."""
    _check(cost, mtbf)
    if cost >= 2.0 * mtbf:
        return mtbf
    x = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost


@dataclass(frozen=True)
class Waste:
    """Expected fractions of wall-clock time (they sum to 1) at interval ``tau``."""

    tau: float
    useful: float
    checkpoint: float
    lost: float
    restart: float

    @property
    def total(self) -> float:
        return self.checkpoint + self.lost + self.restart


def waste(tau: float, cost: float, mtbf: float, restart: float = 0.0) -> Waste:
    """The exact split of Daly's model for one segment of ``tau`` compute + ``cost`` checkpoint."""
    _check(cost, mtbf)
    if not tau > 0:
        raise InvalidArgumentError(f"the interval must be positive, not {tau!r}")
    s = tau + cost
    fails = math.expm1(s / mtbf)  # expected failures per completed segment
    total = mtbf * math.exp(restart / mtbf) * fails
    lost = mtbf * fails - s  # time of the attempts that failed
    restarts = mtbf * fails * math.expm1(restart / mtbf)
    return Waste(tau, tau / total, cost / total, lost / total, restarts / total)


def first_order_waste(tau: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """The back-of-the-envelope waste cost/tau + tau/(2 MTBF) + restart/MTBF (valid when all are small)."""
    return cost / tau + tau / (2.0 * mtbf) + restart / mtbf


def optimum(cost: float, mtbf: float, restart: float = 0.0) -> float:
    """The interval that minimises the exact model's waste (golden-section search; the waste is unimodal)."""
    _check(cost, mtbf)
    lo, hi = 1e-6 * mtbf, 5.0 * mtbf
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    for _ in range(200):
        if waste(a, cost, mtbf, restart).total < waste(b, cost, mtbf, restart).total:
            hi = b
        else:
            lo = a
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if hi - lo < 1e-9 * mtbf:
            break
    return (lo + hi) / 2.0


def table(cost: float, mtbf: float, restart: float = 0.0, around: float | None = None) -> list[Waste]:
    """Waste at a spread of intervals around the optimum (x1/4 .. x4), for the plan report."""
    centre = around if around is not None else daly(cost, mtbf)
    return [waste(centre * f, cost, mtbf, restart) for f in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)]


def mtbf_posterior(prior_s: float, failures: int, uptime_s: float, weight: float = 2.0) -> float:
    """The MTBF to plan with after ``failures`` failures in ``uptime_s`` of running, starting from a prior
    worth ``weight`` failures (a gamma prior on the failure rate): the prior dominates early, the
    observed history once it has more failures than ``weight``."""
    return (weight * prior_s + uptime_s) / (weight + failures)

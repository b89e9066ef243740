"""Monte Carlo of a long training job under failures: what a checkpoint configuration keeps.

One trial runs a job that needs ``work`` seconds of training progress. Failures arrive as a renewal
process (exponential, or Weibull of a given shape, with mean ``mtbf``); each failure has a class
(e.g. ``crash``: the processes died, the nodes are fine; ``node``: a node was lost and replaced),
drawn from a mix. Training alternates ``interval - cost`` seconds of compute with a checkpoint that
blocks for ``cost``; checkpoint number i of a run reaches tier j if i is a multiple of the tier's
``every``, and is usable there ``latency`` seconds after its blocking part ended (asynchronous
persistence). A failure destroys the copies on tiers that do not survive its class; training
resumes from the newest usable copy left (or from scratch), after ``restart`` plus the tier's
``read`` seconds, and a failure during the restart starts the restart over.

Trials run side by side as numpy arrays, one failure per trial per iteration, so thousands of
multi-week trials take well under a second. Goodput is work / wall time, pooled over trials
(the ratio of sums, the consistent estimator of work / E[wall]), with a delta-method confidence
interval. With one tier that survives everything, no latency and exponential failures this is
exactly Daly's model (planner.waste), which tests/test_goodput.py checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .planner import parse_duration

START_OVER = "unrecoverable"  # a failure after which the job starts over: no copy is kept (replay)
DEFAULT_MIX = {"crash": 0.22, "node": 0.78}  # the seed: ~78% of interruptions were hardware (a node goes)


@dataclass(frozen=True)
class TierSpec:
    name: str
    survives: frozenset[str]  # failure classes after which this tier's copy is still usable ("*" = all)
    every: int = 1
    latency: float = 0.0
    read: float = 0.0

    def keeps(self, cls: str) -> bool:
        return "*" in self.survives or cls in self.survives


@dataclass(frozen=True)
class Config:
    name: str
    interval: float  # wall seconds from one checkpoint's start to the next (compute + cost)
    cost: float  # seconds each checkpoint blocks training
    restart: float  # seconds from a failure to training again, before reading the checkpoint
    tiers: tuple[TierSpec, ...] = (TierSpec("durable", frozenset("*")),)
    # Seconds from training again (after a restart and its read) to the end of the run's first
    # checkpoint, where that differs from ``interval``: the first steps of a restarted process are
    # slower (caches, the background work a failure leaves). Used by :func:`replay`; None: interval.
    first: float | None = None

    def __post_init__(self) -> None:
        if not self.cost >= 0 or not self.interval > self.cost:
            raise InvalidArgumentError(f"{self.name}: the interval ({self.interval} s) must exceed the checkpoint "
                                       f"cost ({self.cost} s)")
        if not self.tiers:
            raise InvalidArgumentError(f"{self.name}: a configuration needs at least one tier")
        if self.first is not None and not self.first > self.cost:
            raise InvalidArgumentError(f"{self.name}: the first interval ({self.first} s) must exceed the checkpoint "
                                       f"cost ({self.cost} s)")
        for t in self.tiers:
            if t.every < 1 or t.latency < 0 or t.read < 0:
                raise InvalidArgumentError(f"{self.name}: tier {t.name}: every >= 1, latency and read >= 0")


@dataclass
class Result:
    config: Config
    goodput: float
    ci95: tuple[float, float]
    stderr: float
    fractions: dict[str, float]  # useful, checkpoint, lost, restart: shares of all wall time
    failures: float  # mean failures per trial
    wall_days: float  # mean wall time per trial
    per_trial: np.ndarray = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.config.name, "goodput": self.goodput, "ci95": list(self.ci95), "stderr": self.stderr,
                "fractions": self.fractions, "failures_per_trial": self.failures, "wall_days": self.wall_days,
                "interval_s": self.config.interval, "cost_s": self.config.cost, "restart_s": self.config.restart,
                "tiers": [{"name": t.name, "every": t.every, "latency_s": t.latency, "read_s": t.read,
                           "survives": sorted(t.survives)} for t in self.config.tiers]}


def simulate(config: Config, *, mtbf: float, work: float, trials: int = 2000, seed: int = 0,
             weibull: float | None = None, mix: dict[str, float] | None = None) -> Result:
    """Run ``trials`` independent jobs of ``work`` seconds of progress; see the module docstring."""
    if not mtbf > 0 or not work > 0 or trials < 2:
        raise InvalidArgumentError("mtbf and work must be positive and trials at least 2")
    if weibull is not None and not weibull > 0:
        raise InvalidArgumentError(f"the Weibull shape must be positive, not {weibull!r}")
    mix = dict(mix or DEFAULT_MIX)
    if not mix or any(p < 0 for p in mix.values()) or not sum(mix.values()) > 0:
        raise InvalidArgumentError(f"the failure mix must give non-negative weights, not {mix!r}")
    classes = sorted(mix)
    probs = np.array([mix[c] for c in classes], dtype=float)
    probs /= probs.sum()
    rng = np.random.default_rng(seed)
    period, cost = config.interval, config.cost
    tau = period - cost
    work = math.ceil(work / tau) * tau  # whole segments: the job ends with a checkpoint, as in Daly's model
    tiers = config.tiers
    keeps = np.array([[t.keeps(c) for c in classes] for t in tiers])  # tier x class
    latency = np.array([t.latency for t in tiers])[:, None]
    every = np.array([t.every for t in tiers])[:, None]
    read = np.array([t.read for t in tiers] + [0.0])  # index len(tiers): from scratch
    scale = mtbf / math.gamma(1.0 + 1.0 / weibull) if weibull else mtbf

    wall = np.zeros(trials)
    progress = np.zeros(trials)  # progress the current run started from
    pending = np.zeros(trials)  # restart time owed before compute resumes
    avail = np.full((len(tiers), trials), -np.inf)  # newest usable copy per tier, as progress
    ckpt = np.zeros(trials)
    lost = np.zeros(trials)
    restart = np.zeros(trials)
    failures = np.zeros(trials)
    active = np.arange(trials)
    while active.size:
        n = active.size
        x = scale * (rng.weibull(weibull, n) if weibull else rng.exponential(1.0, n))
        r, p0 = pending[active], progress[active]
        rest = work - p0
        need = rest + cost * np.ceil(rest / tau - 1e-9)
        done = x >= r + need
        d = active[done]
        wall[d] += r[done] + need[done]
        restart[d] += r[done]
        ckpt[d] += need[done] - rest[done]
        # The rest fail: during the restart (run < 0) or while training.
        f = ~done
        a, xf, rf, pf = active[f], x[f], r[f], p0[f]
        run = np.maximum(xf - rf, 0.0)
        wall[a] += xf
        restart[a] += np.minimum(xf, rf)
        cycles = np.floor(run / period)
        rem = run - cycles * period
        computed = cycles * tau + np.minimum(rem, tau)
        ckpt[a] += cycles * cost + np.maximum(rem - tau, 0.0)
        usable = np.floor(np.maximum(run[None, :] - latency, 0.0) / period)  # checkpoints usable per tier
        usable = np.floor(usable / every) * every
        made = np.where(usable > 0, pf[None, :] + usable * tau, -np.inf)
        held = np.maximum(avail[:, a], made)
        cls = rng.choice(len(classes), size=a.size, p=probs)
        held = np.where(keeps[:, cls], held, -np.inf)
        avail[:, a] = held
        best = np.max(held, axis=0)
        source = np.where(np.isfinite(best), np.argmax(held, axis=0), len(tiers))
        restored = np.where(np.isfinite(best), best, 0.0)
        lost[a] += pf + computed - restored
        progress[a] = restored
        pending[a] = config.restart + read[source]
        failures[a] += 1
        active = a
    per_trial = work / wall
    total = wall.sum()
    goodput = work * trials / total
    # Delta method for work / mean(wall).
    stderr = goodput * wall.std(ddof=1) / (math.sqrt(trials) * wall.mean())
    fractions = {"useful": work * trials / total, "checkpoint": ckpt.sum() / total, "lost": lost.sum() / total,
                 "restart": restart.sum() / total}
    return Result(config, goodput, (goodput - 1.96 * stderr, goodput + 1.96 * stderr), stderr, fractions,
                  float(failures.mean()), float(wall.mean() / 86400), per_trial)


def replay(config: Config, failures: list[tuple[float, str]], horizon: float) -> dict[str, float]:
    """One job over ``horizon`` wall seconds with failures at the given times (seconds from its
    start) and of the given classes, under the same rules as :func:`simulate`; the job starts with a
    restart (its start-up), and a failure of class ``START_OVER`` (a job that could not restore and
    was started afresh) leaves no copy anywhere. Returns the split of the horizon in seconds: ``useful`` (the progress
    kept at the end), ``checkpoint``, ``lost``, ``restart`` and ``reload`` (reading the copy restored
    from), which add up to ``horizon``. This is the simulator's prediction for a run whose failures
    are known, such as a measured crash loop."""
    tiers, period, cost = config.tiers, config.interval, config.cost
    tau = period - cost
    first = config.first if config.first is not None else period  # each run's first cycle
    tau1 = first - cost

    def count(t: float) -> int:  # checkpoints a run has ended by t seconds of training
        return 0 if t < first else 1 + math.floor((t - first) / period)

    def work(k: int) -> float:  # progress a run's k-th checkpoint holds
        return tau1 + (k - 1) * tau if k > 0 else 0.0

    held = [-math.inf] * len(tiers)
    out = dict.fromkeys(("useful", "checkpoint", "lost", "restart", "reload"), 0.0)
    progress, restart, read, t = 0.0, config.restart, 0.0, 0.0
    for end, cls in sorted(f for f in failures if f[0] < horizon) + [(horizon, "")]:
        x = max(0.0, end - t)
        out["restart"] += min(x, restart)
        out["reload"] += min(max(x - restart, 0.0), read)
        run = max(x - restart - read, 0.0)
        done = count(run)
        rem = run - (first + (done - 1) * period if done else 0.0)  # into the cycle under way
        computed = work(done) + min(rem, tau if done else tau1)
        out["checkpoint"] += done * cost + max(rem - (tau if done else tau1), 0.0)
        if not cls:
            progress += computed
            break
        for j, tier in enumerate(tiers):
            usable = count(max(run - tier.latency, 0.0)) // tier.every * tier.every
            made = progress + work(usable) if usable > 0 else -math.inf
            held[j] = max(held[j], made) if tier.keeps(cls) and cls != START_OVER else -math.inf
        best = max(held)
        restored = best if math.isfinite(best) else 0.0
        out["lost"] += progress + computed - restored
        progress, restart = restored, config.restart
        read = tiers[held.index(best)].read if math.isfinite(best) else 0.0
        t = end
    out["useful"] = progress
    return out


# ------------------------------------------------------------------------------ configurations


def tier_from_spec(spec: str) -> TierSpec:
    """``NAME[:every=K,latency=D,read=D,survives=crash+node]``; survives defaults to all for 'durable'
    and to 'crash' for anything else."""
    name, _, opts = spec.partition(":")
    fields: dict[str, Any] = {"survives": frozenset("*") if name == "durable" else frozenset({"crash"})}
    for item in filter(None, opts.split(",")):
        k, sep, v = item.partition("=")
        if not sep:
            raise InvalidArgumentError(f"tier {spec!r}: {item!r} is not key=value")
        if k == "every":
            if not v.isdigit() or int(v) < 1:
                raise InvalidArgumentError(f"tier {spec!r}: every must be a positive integer, not {v!r}")
            fields["every"] = int(v)
        elif k in ("latency", "read"):
            fields[k] = parse_duration(v, f"tier {name} {k}")
        elif k == "survives":
            fields["survives"] = frozenset("*" if v in ("all", "*") else v.split("+"))
        else:
            raise InvalidArgumentError(f"tier {spec!r}: unknown option {k!r} (every, latency, read, survives)")
    return TierSpec(name, **fields)


def mix_from_spec(spec: str) -> dict[str, float]:
    """``crash=0.22,node=0.78``: failure classes and their weights."""
    mix = {}
    for item in filter(None, spec.split(",")):
        k, sep, v = item.partition("=")
        try:
            mix[k] = float(v) if sep and k else float("nan")
        except ValueError:
            mix[k] = float("nan")
        if not mix[k] >= 0:
            raise InvalidArgumentError(f"failure mix {spec!r}: {item!r} is not CLASS=WEIGHT with a weight >= 0")
    return mix


def config_from_json(doc: dict[str, Any]) -> Config:
    """``{"name", "interval", "cost", "restart", "tiers": ["ram:survives=crash", ...]}`` (durations as in
    parse_duration)."""
    try:
        tiers = tuple(tier_from_spec(t) for t in doc.get("tiers", ["durable"]))
        return Config(str(doc["name"]), parse_duration(doc["interval"], "interval"), parse_duration(doc["cost"], "cost"),
                      parse_duration(doc.get("restart", 0), "restart"), tiers)
    except KeyError as exc:
        raise InvalidArgumentError(f"configuration {doc!r} lacks {exc}") from None


def seed_example() -> list[Config]:
    """The seed's production example, and the same job with ckptstore's tiers.

    Before: synchronous checkpoints that block for 6 minutes every hour, straight to durable storage,
    and 25 minutes of manual triage per failure. After: 20 s of blocking, every 20 minutes, written to
    durable storage in the background (taking the same 6 minutes, now off the training path), with
    automatic restarts (5 minutes assumed). With ckptstore: RAM and peer replicas in front of that
    (usable ~10 s and ~1 min after the blocking part), restored from in ~1 min instead of 6."""
    durable = TierSpec("durable", frozenset("*"), 1, 0.0, 0.0)
    return [
        Config("sync 6 min / 1 h, manual restart", 3600.0, 360.0, 1500.0, (durable,)),
        Config("async 20 s / 20 min, auto restart", 1200.0, 20.0, 300.0,
               (TierSpec("durable", frozenset("*"), 1, 360.0, 360.0),)),
        Config("+ RAM and peer tiers", 1200.0, 20.0, 300.0,
               (TierSpec("ram", frozenset({"crash"}), 1, 10.0, 30.0),
                TierSpec("peer", frozenset({"crash", "node"}), 1, 60.0, 60.0),
                TierSpec("durable", frozenset("*"), 3, 360.0, 360.0))),
    ]

"""The ``ckptstore`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ._units import format_bytes
from ._version import __version__
from .errors import CheckpointError, InvalidArgumentError


def _open(url: str, storage_options: dict[str, Any] | None):
    from .checkpoint.inspect import open_any

    return open_any(url, storage_options)


def _storage_options(text: str) -> dict[str, Any]:
    # Raised as ArgumentTypeError, argparse prints this message alone: its default message for a
    # bad value repeats the value, which holds credentials as often as not.
    try:
        value = json.loads(text)
    except ValueError as exc:
        msg = getattr(exc, "msg", "invalid JSON")
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({msg}, at character {getattr(exc, 'pos', '?')}); the value is not repeated here "
            "since it may hold credentials"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of fsspec options, not a JSON {type(value).__name__}")
    return value


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None, file=sys.stderr)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint.inspect import summary

    if getattr(args, "timings", False):
        return cmd_timings(args)
    opened = _open(args.url, args.storage_options)
    try:
        info = summary(opened)
    finally:
        opened.close()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"{info['location']}: ckptstore {info['layout']} checkpoint, format {info['format_version']} ({info['writer']})")
    size = f", file {format_bytes(info['file_bytes'])}" if info["file_bytes"] is not None else ""
    print(
        f"  {info['num_tensors']} tensors in {info['num_chunks']} chunks, "
        f"{format_bytes(info['tensor_bytes'])} of tensor data, {format_bytes(info['stored_bytes'])} stored{size}"
    )
    if info["layout"] == "sharded":
        print(f"  saved by {info['world_size']} ranks:")
        slow = set(info["stragglers"])
        for r in info["ranks"]:
            t = r.get("timings", {})
            flag = "  <- straggler (over 2x the median write time)" if r["rank"] in slow else ""
            print(
                f"    rank {r['rank']:5d} on {r.get('host', '?')}: wrote {format_bytes(r.get('bytes', 0))}, "
                f"plan {t.get('plan_s', 0):.3f} s, write {t.get('write_s', 0):.3f} s{flag}"
            )
    if info["top_level_keys"] is not None:
        print(f"  top-level keys: {', '.join(map(str, info['top_level_keys']))}")
    if info["pickled"]:
        print(f"  pickled objects (need weights_only=False): {', '.join(info['pickled'])}")
    width = max([len(t["key"]) for t in info["tensors"]] + [3])
    layouts = any(t.get("saved_layout") for t in info["tensors"])
    print(f"  {'key':{width}s}  {'dtype':14s} {'shape':20s} {'bytes':>12s} chunks codec  split dims"
          + ("  saved mesh and placements" if layouts else ""))
    for t in info["tensors"]:
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        split = ",".join(map(str, t["split_dims"])) or "-"
        saved = f"  {t.get('saved_layout') or '-'}" if layouts else ""
        print(
            f"  {t['key']:{width}s}  {t['dtype']:14s} {shape:20s} {format_bytes(t['bytes']):>12s} {t['chunks']:6d} "
            f"{t['codec']:6s} {split}{saved}"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .checkpoint.inspect import scan

    opened = _open(args.url, args.storage_options)
    try:
        total = sum(c.length for e in opened.manifest.tensors.values() for c in e.chunks)
        with _progress(total, "verify") as bar:
            checked, bad = scan(opened, bar.update)
    finally:
        opened.close()
    if bad:
        print(f"{args.url}: {len(bad)} of {checked} chunks are damaged:")
        for b in bad:
            where = f"{b.file} " if b.file else ""
            print(f"  tensor {b.key!r} chunk {b.index} ({where}bytes {b.offset}..{b.offset + b.length}): {b.problem}")
        return 1
    print(f"{args.url}: sound ({checked} chunks, {format_bytes(total)} checked)")
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    import logging

    from .engine.agent import STORAGE_OPTIONS_ENV, NodeAgent, hold_agent_lock

    options = args.storage_options
    if options is None and os.environ.get(STORAGE_OPTIONS_ENV):
        options = _storage_options(os.environ[STORAGE_OPTIONS_ENV])  # handed over by CheckpointStore(agent=True)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger = logging.getLogger("ckptstore")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    agent = NodeAgent(args.job, local=args.local, durable=args.durable, ram_dir=args.ram_dir, storage_options=options)
    locks = [args.lock_fd if args.lock_fd is not None else hold_agent_lock(args.job, args.ram_dir)]

    def release() -> None:
        while locks:
            os.close(locks.pop())

    try:
        if not args.once:
            agent.watch(poll_s=args.poll, exit_when_idle=args.exit_when_idle, release=release,
                        keep_ram=args.keep_ram, linger_s=args.linger)
            return 0
        out = agent.run_once()
        freed = (0, 0) if args.keep_ram else agent.release_persisted()
    finally:
        release()
    for what, steps in (("committed in the local tier", out.local), ("committed in the durable tier", out.durable),
                        ("waiting in the durable tier for other nodes' parts", out.waiting),
                        ("failed (see the log above)", out.failed)):
        if steps:
            print(f"steps {', '.join(map(str, steps))}: {what}")
    if not (out.local or out.durable or out.waiting or out.failed):
        print(f"nothing to persist for job {args.job} in {args.ram_dir}")
    if freed[0]:
        print(f"removed {freed[0]} RAM segments of dead trainers whose steps are persisted ({freed[1]} bytes)")
    return 1 if out.failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(args.dir, mib=args.mib, use_s3=not args.no_s3, steps=args.steps)
    return 0 if result["ok"] else 1


def cmd_ram(args: argparse.Namespace) -> int:
    from .tiers.segments import inventory, remove_job

    ram_dir = args.ram_dir
    if args.ram_command == "rm":
        removed = remove_job(args.job, ram_dir, force=args.force)
        if not removed:
            print(f"no RAM segments of job {args.job} in {ram_dir}")
        else:
            print(f"removed {len(removed)} RAM segment{'' if len(removed) == 1 else 's'} of job {args.job} from {ram_dir} "
                  f"({format_bytes(sum(r.size for r in removed))} freed)")
        return 0
    records = inventory(ram_dir)
    if args.json:
        print(json.dumps([{"job": r.job, "rank": r.rank, "replica_of": r.src, "slot": r.slot, "step": r.step,
                           "bytes": r.size, "owner_pid": r.owner_pid, "owner_alive": r.owner_alive,
                           "elsewhere": None if r.elsewhere is None else list(r.elsewhere), "files": list(r.paths)}
                          for r in records], indent=2))
        return 0
    print(f"RAM segments in {ram_dir}: {len(records)} ({format_bytes(sum(r.size for r in records))})")
    if not records:
        return 0
    rows = [("job", "rank", "slot", "step", "size", "owner", "step elsewhere")]
    for r in records:
        owner = "unknown" if r.owner_pid is None else f"{r.owner_pid} ({'alive' if r.owner_alive else 'exited'})"
        if r.step is None:
            elsewhere = "-"
        elif r.elsewhere is None:
            elsewhere = "unknown"
        else:
            elsewhere = "+".join(r.elsewhere) or "nowhere"
        slot = f"s{r.slot}" if r.src is None else f"s{r.slot} (replica of rank {r.src})"
        rows.append((r.job, str(r.rank), slot, "-" if r.step is None else str(r.step), format_bytes(r.size), owner,
                     elsewhere))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("  step '-': nothing committed in the segment. 'step elsewhere': the lower tiers holding that step or a newer "
          "one, read from the local directory and durable URL each segment's document records ('unknown': an object "
          "store, which is not contacted, or a document that records no tiers). `ckptstore ram rm JOB` removes a job's segments.")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from .checkpoint.inspect import open_any
    from .checkpoint.materialize import decode_value
    from .checkpoint.reshard import reshard

    opened = open_any(args.src, args.storage_options)
    total = opened.manifest.total_bytes
    opened.close()
    with _progress(total, "reshard") as bar:
        report = reshard(
            args.src,
            args.dst,
            args.ranks,
            storage_options=args.storage_options,
            buffer_bytes=args.buffer_mib << 20,
            progress=bar.update,
            decode_per_rank=decode_value,
        )
    layout = "one single-file checkpoint" if args.ranks == 1 else f"{args.ranks} even Shard(0) ranks"
    print(f"{args.dst}: {report['tensors']} tensors, {format_bytes(report['bytes'])}, laid out for {layout}")
    if report["dropped_per_rank"]:
        print(f"  per-rank values dropped (their ranks do not exist at this size): {', '.join(report['dropped_per_rank'])}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    report = convert(
        args.src,
        args.dst,
        args.to,
        storage_options=args.storage_options,
        allow_pickle=args.allow_pickle,
        progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
    )
    print(
        f"{args.dst}: {report['dst_format']} ({report['tensors']} tensors, {format_bytes(report['bytes'])}) "
        f"from {report['src_format']} {args.src}"
    )
    for note in report.get("notes", []):
        print(f"  note: {note}")
    if report.get("dropped"):
        print(f"  dropped (the destination format cannot hold them): {', '.join(map(str, report['dropped']))}")
    return 0


# ------------------------------------------------------------------------------ goodput commands


def _newest_step(url: str, storage_options: dict[str, Any] | None) -> str:
    """``url`` when it is a checkpoint; the newest committed step under it when it is a tier's root."""
    from .checkpoint.inspect import is_sharded
    from .checkpoint.sharded import MANIFEST, Directory

    if not is_sharded(url, storage_options):
        return url
    directory = Directory(url, storage_options)
    if directory.exists(MANIFEST):
        return url
    from .tiers.directory import DirectoryTier

    steps = DirectoryTier("inspect", url, storage_options=storage_options).steps_sync()
    if not steps:
        raise CheckpointError(f"{url}: neither a checkpoint nor a directory of committed steps")
    return f"{url.rstrip('/')}/step-{steps[-1]:012d}"


def cmd_timings(args: argparse.Namespace) -> int:
    from .goodput.timings import STAGES, stage_table, stragglers

    url = _newest_step(args.url, args.storage_options)
    opened = _open(url, args.storage_options)
    try:
        manifest = opened.manifest
    finally:
        opened.close()
    ranks = manifest.meta.get("ranks", [])
    if manifest.kind != "sharded" or not ranks:
        raise CheckpointError(f"{url}: a single-file checkpoint records no per-rank timings")
    slow = stragglers(ranks, factor=args.factor)
    sdc = manifest.meta.get("sdc")
    if args.json:
        json.dump({"location": url, "ranks": ranks, "stragglers": slow, "sdc": sdc}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    stages, rows = stage_table(ranks)
    print(f"{url}: per-rank stage timings (seconds) of step {manifest.meta.get('step', '?')}, {len(rows)} ranks")
    width = max([len(str(r["host"])) for r in rows] + [4])
    print(f"  {'rank':>5s}  {'host':{width}s}  " + "  ".join(f"{s[:-2]:>10s}" for s in stages))
    flagged = {(x["rank"], x["stage"]) for x in slow}
    for r in rows:
        cells = []
        for s in stages:
            v = r[s]
            cell = "-" if v is None else f"{v:.3f}" + ("*" if (r["rank"], s) in flagged else "")
            cells.append(f"{cell:>10s}")
        print(f"  {r['rank']:5d}  {str(r['host']):{width}s}  " + "  ".join(cells))
    print("  stages: " + "; ".join(f"{s[:-2]} = {STAGES.get(s, s)}" for s in stages))
    if slow:
        print(f"  stragglers (over {args.factor:g}x the median of a stage, marked *), by host:")
        for host in sorted({str(x["host"]) for x in slow}):
            items = [x for x in slow if str(x["host"]) == host]
            print(f"    {host}: " + "; ".join(f"rank {x['rank']} {x['stage'][:-2]} {x['seconds']:.3f} s "
                                             f"({x['ratio']:.1f}x median {x['median_s']:.3f} s)" for x in items))
    else:
        print(f"  no straggler: no rank over {args.factor:g}x the median of any stage")
    if sdc and sdc.get("mismatches"):
        from .goodput.sdc import describe

        print("  " + describe(int(manifest.meta.get("step", -1)), sdc["mismatches"]))
    return 0


def _mtbf_args(args: argparse.Namespace, required: bool = True) -> float | None:
    from .goodput.planner import mtbf_from_rate, parse_duration

    if args.mtbf is not None:
        return parse_duration(args.mtbf, "--mtbf")
    if args.observed is not None:
        count, over, on = args.observed
        gpus = args.gpus if args.gpus is not None else float(on)
        return mtbf_from_rate(float(count), parse_duration(over, "--observed duration"), float(on), float(gpus))
    if args.failure_rate is not None:
        if args.gpus is None:
            raise CheckpointError("--failure-rate is per GPU per day: pass --gpus too")
        return 86400.0 / (args.failure_rate * args.gpus)
    if required:
        raise CheckpointError("give the MTBF: --mtbf 3h, or --observed COUNT DURATION GPUS [--gpus N] "
                              "(e.g. --observed 419 54d 16384), or --failure-rate PER_GPU_DAY --gpus N")
    return None


def _bench_cost(path: str) -> float:
    """The blocking seconds of one checkpoint that ``ckptstore bench --json`` measured."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
        cost = doc["checkpoint_cost"]["blocking_s"]
    except OSError as exc:
        raise CheckpointError(f"--bench {path}: cannot read it: {exc}") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"--bench {path}: not the JSON of `ckptstore bench --json` (no checkpoint_cost.blocking_s); "
                              "run ckptstore bench with --ram (or no target) to measure it") from None
    if not isinstance(cost, (int, float)) or isinstance(cost, bool) or cost <= 0:
        raise CheckpointError(f"--bench {path}: checkpoint_cost.blocking_s is {cost!r}; the RAM tier was not measured "
                              "(run ckptstore bench with --ram)")
    return float(cost)


def cmd_plan(args: argparse.Namespace) -> int:
    from .goodput.planner import daly, first_order_waste, human, optimum, parse_duration, table, waste, young

    if (args.ckpt_cost is None) == (args.bench is None):
        raise CheckpointError("give the checkpoint cost: --ckpt-cost 60s, or --bench bench.json (from ckptstore bench)")
    cost = parse_duration(args.ckpt_cost, "--ckpt-cost") if args.ckpt_cost is not None else _bench_cost(args.bench)
    restart = parse_duration(args.restart, "--restart")
    mtbf = _mtbf_args(args)
    assert mtbf is not None
    if cost <= 0:
        raise CheckpointError("--ckpt-cost must be positive")
    y, d, o = young(cost, mtbf), daly(cost, mtbf), optimum(cost, mtbf, restart)
    best = waste(d, cost, mtbf, restart)
    rows = table(cost, mtbf, restart, around=d)
    if args.json:
        json.dump({"cost_s": cost, "mtbf_s": mtbf, "restart_s": restart, "young_s": y, "daly_s": d, "optimum_s": o,
                   "waste_at_daly": best.__dict__ | {"total": best.total},
                   "first_order_waste_at_young": first_order_waste(y, cost, mtbf, restart),
                   "table": [r.__dict__ | {"total": r.total} for r in rows]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"checkpoint cost {human(cost)}, MTBF {human(mtbf)} ({mtbf / 60:.4g} min), restart {human(restart)}")
    print(f"  Young  sqrt(2 * cost * MTBF):  checkpoint every {human(y)} of training "
          f"(first-order waste {first_order_waste(y, cost, mtbf, restart) * 100:.1f}%)")
    print(f"  Daly   higher-order:           checkpoint every {human(d)} of training")
    print(f"  exact optimum of the model:    every {human(o)}")
    print(f"  expected waste at Daly's interval: {best.total * 100:.1f}% = checkpoint overhead {best.checkpoint * 100:.1f}%"
          f" + lost work {best.lost * 100:.1f}% + restart {best.restart * 100:.1f}%  (goodput {best.useful * 100:.1f}%)")
    print(f"  {'interval':>10s} {'overhead':>9s} {'lost':>7s} {'restart':>8s} {'waste':>7s} {'goodput':>8s}")
    for r in rows:
        mark = "  <- Daly" if r.tau == d else ""
        print(f"  {human(r.tau):>10s} {r.checkpoint * 100:8.1f}% {r.lost * 100:6.1f}% {r.restart * 100:7.1f}% "
              f"{r.total * 100:6.1f}% {r.useful * 100:7.1f}%{mark}")
    print("  (interval = training time between checkpoints; waste from Daly's model: exponential failures, a failure "
          "loses the work since the last checkpoint, each costs a restart)")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from .goodput.planner import human, parse_duration, waste
    from .goodput.simulate import Config, config_from_json, mix_from_spec, seed_example, simulate, tier_from_spec

    mtbf = _mtbf_args(args, required=False)
    configs: list[Config] = []
    if args.example == "seed":
        configs += seed_example()
        if mtbf is None:
            from .goodput.planner import mtbf_from_rate

            mtbf = mtbf_from_rate(419, 54 * 86400, 16384, 4096)
    for spec in args.config or []:
        text = _read_text(spec) if os.path.isfile(spec) else spec
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(f"--config {spec!r} is neither a JSON file nor inline JSON: {exc}") from None
        configs += [config_from_json(d) for d in (doc if isinstance(doc, list) else [doc])]
    if args.interval is not None or not configs:
        if args.interval is None or args.cost is None:
            raise CheckpointError("give a configuration: --interval and --cost (plus --restart, --tier), --config "
                                  "JSON, or --example seed")
        tiers = tuple(tier_from_spec(t) for t in (args.tier or ["durable"]))
        configs.append(Config(args.name, parse_duration(args.interval, "--interval"), parse_duration(args.cost, "--cost"),
                              parse_duration(args.restart, "--restart"), tiers))
    if mtbf is None:
        raise CheckpointError("give the MTBF: --mtbf 3h, or --observed COUNT DURATION GPUS [--gpus N]")
    mix = mix_from_spec(args.mix) if args.mix else None
    work = parse_duration(args.work, "--work")
    results = [simulate(c, mtbf=mtbf, work=work, trials=args.trials, seed=args.seed, weibull=args.weibull, mix=mix)
               for c in configs]
    if args.json:
        json.dump({"mtbf_s": mtbf, "work_s": work, "trials": args.trials, "seed": args.seed, "weibull": args.weibull,
                   "results": [r.to_json() for r in results]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        law = f"Weibull shape {args.weibull:g}" if args.weibull else "exponential"
        print(f"{args.trials} trials of a job needing {human(work)} of training, MTBF {human(mtbf)} ({law}), seed {args.seed}")
        width = max(len(c.name) for c in configs)
        print(f"  {'configuration':{width}s}  {'goodput':>8s}  {'95% CI':>15s}  {'ckpt':>6s} {'lost':>6s} "
              f"{'restart':>7s}  failures  wall")
        for r in results:
            f = r.fractions
            print(f"  {r.config.name:{width}s}  {r.goodput * 100:7.2f}%  [{r.ci95[0] * 100:5.2f}, {r.ci95[1] * 100:5.2f}]%  "
                  f"{f['checkpoint'] * 100:5.1f}% {f['lost'] * 100:5.1f}% {f['restart'] * 100:6.1f}%  {r.failures:8.1f}"
                  f"  {r.wall_days:.1f} d")
        for r in results:
            c = r.config
            simple = len(c.tiers) == 1 and c.tiers[0].latency == 0 and c.tiers[0].read == 0 and c.tiers[0].every == 1
            if simple and not args.weibull and "*" in c.tiers[0].survives:
                exact = waste(c.interval - c.cost, c.cost, mtbf, c.restart).useful
                print(f"  {c.name}: Daly's model gives {exact * 100:.2f}% (the simulation's 95% CI "
                      f"{'contains' if r.ci95[0] <= exact <= r.ci95[1] else 'misses'} it)")
    if args.plot:
        _plot_simulation(results, args.plot, mtbf)
        print(f"  plot: {args.plot}", file=sys.stderr)
    return 0


def _read_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _plot_simulation(results: list[Any], path: str, mtbf: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.7 * len(results)))
    colors = {"useful": "#2ca02c", "checkpoint": "#1f77b4", "lost": "#ff7f0e", "restart": "#d62728"}
    for i, r in enumerate(results):
        left = 0.0
        for name, share in r.fractions.items():
            ax.barh(i, share * 100, left=left, color=colors[name], label=name if i == 0 else None)
            left += share * 100
        ax.text(101, i, f"{r.goodput * 100:.1f}% (±{1.96 * r.stderr * 100:.2f})", va="center", fontsize=8)
    ax.set_yticks(range(len(results)), [r.config.name for r in results], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 115)
    ax.set_xlabel(f"% of wall-clock time (MTBF {mtbf / 3600:.3g} h)")
    ax.legend(ncol=4, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _read_log(root: str) -> tuple[str, list[dict[str, Any]]]:
    from .goodput.events import events_path, read_events

    path = events_path(root)
    try:
        events = read_events(path)
    except FileNotFoundError:
        raise CheckpointError(f"no event log at {path}: create the CheckpointStore with events=True (or events=PATH)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read the event log {path}: {exc}") from None
    if not events:
        raise CheckpointError(f"{path} holds no events yet")
    return path, events


def cmd_goodput(args: argparse.Namespace) -> int:
    from .goodput.events import account, plot, predicted
    from .goodput.planner import human

    if args.plot and len(args.root) > 1:
        raise InvalidArgumentError("--plot draws one log: name one log with it")
    common = _common_step(args.step_s, [account(_read_log(root)[1]) for root in args.root] if args.step_s == "min" else [])
    docs = []
    for root in args.root:
        path, events = _read_log(root)
        acc = account(events)
        if common is not None and acc.useful_steps is not None:
            acc = dataclasses.replace(acc, step_s=common)
        setup = next((e for e in events if e["event"] == "setup"), {})
        doc = {"log": path, "config": setup.get("config"), **acc.to_json(),
               "step": "the median step" if common is None else "the common step"}
        if args.simulate:
            try:
                doc["simulated"] = predicted(events, acc)
            except InvalidArgumentError as exc:
                doc["simulated"] = None
                print(f"ckptstore goodput: {path}: no simulation: {exc}", file=sys.stderr)
        docs.append(doc)
        if not args.json:
            _print_account(doc, acc, human)
        if args.plot:
            plot(acc, args.plot, title=os.path.basename(os.path.abspath(root)))
            print(f"  plot: {args.plot}", file=sys.stderr)
    if args.json:
        json.dump(docs[0] if len(docs) == 1 else docs, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif len(docs) > 1:
        _print_comparison(docs)
    return 0


_PARTS = ("checkpoint", "lost", "restart", "reload")


def _common_step(spec: str | None, accounts: list[Any]) -> float | None:
    """The step time ``--step-s`` gives every log: seconds, or ``min``, the smallest median step of
    the logs (the step least slowed by what runs beside it); None: each log's own median."""
    if spec is None:
        return None
    if spec == "min":
        steps = [a.step_s for a in accounts if a.step_s is not None]
        if not steps:
            raise InvalidArgumentError("--step-s min: none of these logs records step times (tick events with step_s)")
        return min(steps)
    try:
        value = float(spec)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InvalidArgumentError(f"--step-s must be a positive number of seconds or 'min', not {spec!r}")
    return value


def _print_account(doc: dict[str, Any], acc: Any, human: Any) -> None:
    fr = acc.fractions()
    name = f" ({doc['config']})" if doc["config"] else ""
    print(f"{doc['log']}{name}: {len(acc.runs)} run(s), {acc.failures} failure(s), {acc.saves} save(s) over "
          f"{human(acc.wall)}" + (f" (+ {human(acc.idle)} idle between clean runs)" if acc.idle else ""))
    if acc.useful_steps is not None:
        print(f"  {'useful':11s} {human(acc.useful):>10s}  {acc.goodput * 100:5.1f}%  "
              f"({acc.useful_steps} steps x {acc.step_s:.3g} s, {doc['step']})")
        print(f"  {'slowdown':11s} {human(acc.productive - acc.useful):>10s}  "
              f"{(fr['productive'] - acc.goodput) * 100:5.1f}%  (steps slower than that)")
    else:
        print(f"  {'productive':11s} {human(acc.productive):>10s}  {fr['productive'] * 100:5.1f}%")
    for part in _PARTS:
        print(f"  {part:11s} {human(getattr(acc, part)):>10s}  {fr[part] * 100:5.1f}%")
    print(f"  goodput {acc.goodput * 100:.1f}%")
    per = acc.per_save()
    if per is not None:
        print(f"  per save: {per[0]:.3g} s blocking + {per[1]:.3g} s slowdown = {sum(per):.3g} s; the interval for "
              f"it: ckptstore plan --ckpt-cost {sum(per):.3g}s --mtbf ...")
    sim = doc.get("simulated")
    if sim:
        sf = sim["fractions"]
        tiers = ", ".join(f"{t['name']} (+{t['latency_s']:.3g} s, read {t['read_s']:.3g} s)" for t in sim["tiers"])
        first = f" (a run's first {sim['first_s']:.3g} s)" if sim.get("first_s") is not None else ""
        print(f"  simulator, replaying these {sim['failures']} failure(s) with interval {sim['interval_s']:.3g} s{first}, "
              f"cost {sim['cost_s']:.3g} s, restart {sim['restart_s']:.3g} s, tiers {tiers}:")
        print(f"    productive {sf['useful'] * 100:.1f}% (measured {fr['productive'] * 100:.1f}%)  "
              + "  ".join(f"{p} {sf[p] * 100:.1f}% ({fr[p] * 100:.1f}%)" for p in _PARTS))
    if acc.open_run:
        print("  note: the last run has not closed (still running, or it died and was not restarted); its time "
              "counts as productive until it is known to be lost")


def _print_comparison(docs: list[dict[str, Any]]) -> None:
    sim = any("simulated" in d for d in docs)
    print(f"\n  {'log':32s} {'goodput':>7s} {'steps':>6s} {'product.':>8s} " + " ".join(f"{p:>10s}" for p in _PARTS)
          + f" {'failures':>8s}" + (f" {'sim. product.':>13s}" if sim else ""))
    for d in docs:
        fr = d["fractions"]
        label = d["config"] or d["log"]
        steps = "-" if d["useful_steps"] is None else str(d["useful_steps"])
        print(f"  {label[-32:]:32s} {d['goodput'] * 100:6.1f}% {steps:>6s} {fr['productive'] * 100:7.1f}% "
              + " ".join(f"{fr[p] * 100:9.1f}%" for p in _PARTS) + f" {d['failures']:8d}"
              + (f" {d['simulated']['fractions']['useful'] * 100:12.1f}%" if d.get("simulated") else ""))


def cmd_bench(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from ._units import parse_size
    from .bench import BenchConfig, format_table, plot, run_bench

    size = parse_size(args.size, "--size")
    any_target = args.ram or args.local or args.durable or args.peer
    local = args.local
    scratch = None
    if not any_target:  # nothing named: this machine's RAM and its temp directory's disk
        scratch = local = tempfile.mkdtemp(prefix="ckptstore-bench-", dir=os.getcwd())
    cfg = BenchConfig(
        size=size,
        ram=args.ram or not any_target,
        local=local,
        durable=args.durable,
        storage_options=args.storage_options,
        peer=args.peer,
        repeats=args.repeats,
        sweep=not args.no_sweep,
        sweep_size=parse_size(args.sweep_size, "--sweep-size") if args.sweep_size else None,
        state_size=parse_size(args.state_size, "--state-size") if args.state_size else None,
        ram_dir=args.ram_dir,
        progress=None,
    )
    try:
        doc = run_bench(cfg)
    finally:
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        print(f"  JSON: {args.json} (CheckpointStore(..., tuning={args.json!r}) applies its recommended settings)")
    if args.plot and plot(doc, args.plot):
        print(f"  plot: {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstore", description="Tiered asynchronous checkpoint storage for PyTorch.")
    parser.add_argument("--version", action="version", version=f"ckptstore {__version__}")
    parser.add_argument(
        "--storage-options",
        type=_storage_options,
        default=None,
        metavar="JSON",
        help='fsspec storage options for URLs, as JSON (e.g. \'{"anon": true}\')',
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("inspect", help="show what a checkpoint holds", description="Show keys, dtypes, shapes and sizes.")
    p.add_argument("url", help="checkpoint path or fsspec URL")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--timings", action="store_true",
                   help="per-rank stage timings of a step (or of a tier's newest step) and the stragglers, by host")
    p.add_argument("--factor", type=float, default=2.0, help="with --timings: flag ranks over this many times the "
                   "median of a stage (default 2)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser(
        "verify",
        help="re-read every chunk and check its checksum",
        description="Re-read every chunk and check its checksum. Exit 0 when sound, 1 when any chunk is damaged.",
    )
    p.add_argument("url", help="checkpoint path or fsspec URL")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser(
        "reshard",
        help="rewrite a sharded checkpoint for N ranks, or consolidate it into one file",
        description="Rewrite a sharded checkpoint so that each of N even Shard(0) ranks reads one contiguous "
        "region of each tensor; --ranks 1 consolidates it into the single-file format. Streams with bounded memory.",
    )
    p.add_argument("src", help="source checkpoint directory (path or fsspec URL)")
    p.add_argument("dst", help="destination (a new directory; a file path with --ranks 1)")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks to lay the checkpoint out for")
    p.add_argument("--buffer-mib", type=int, default=256, help="staging memory for reads, in MiB (default 256)")
    p.set_defaults(func=cmd_reshard)
    p = sub.add_parser(
        "convert",
        help="convert between ckptstore, torch.save files, safetensors and DCP directories",
        description="Convert a checkpoint between formats, both ways: ckptstore (single file or sharded "
        "directory as source), torch.save files, safetensors files and torch.distributed.checkpoint directories. "
        "The destination must not exist.",
    )
    p.add_argument("src", help="source checkpoint (file, directory or fsspec URL); its format is detected")
    p.add_argument("dst", help="destination (must not exist)")
    p.add_argument("--to", required=True, choices=["ckptstore", "torch", "safetensors", "dcp"], help="destination format")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow unpickling (torch files with arbitrary objects, DCP metadata); only for files you trust",
    )
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser(
        "demo",
        help="run the main job on embedded defaults (local directory + local S3 server)",
        description="Train a small model with a CheckpointStore (local directory + a local S3 server, SeaweedFS or moto on "
        "127.0.0.1), kill the training process halfway with SIGKILL, restore in a new process and finish; check "
        "that the resumed run is bitwise equal to an uninterrupted one and report what each tier holds.",
    )
    p.add_argument("--dir", default=None, help="keep the files in this directory (default: a temp dir, removed)")
    p.add_argument("--mib", type=int, default=64, help="approximate size of model + Adam state in MiB (default 64)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60; the crash comes halfway)")
    p.add_argument("--no-s3", action="store_true", help="skip the local S3 server")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser(
        "ram",
        usage="%(prog)s [-h] [--ram-dir DIR] [--json] [rm JOB [--force]]",
        help="list this node's RAM-tier segments (/dev/shm), or remove a job's",
        description="List the RAM-tier segments (staging slots and peer replicas) in a RAM directory by job, rank "
        "and step: their size, whether the process that owns them is alive, and whether their step exists at a "
        "lower tier (the local directory, or a durable URL that is a path on this node, as each segment's document "
        "records them). `ckptstore ram rm JOB` removes a job's segments.",
    )
    p.add_argument("--ram-dir", default="/dev/shm", metavar="DIR", help="the RAM directory (default /dev/shm)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_ram, ram_command=None)
    ram = p.add_subparsers(dest="ram_command", metavar="rm", prog="ckptstore ram")
    q = ram.add_parser(
        "rm",
        help="remove a job's segments",
        description="Remove the RAM-tier segments of JOB. Without --force, refuses (and removes nothing) when a "
        "segment's owner process is alive, or its step exists at no lower tier this node can see.",
    )
    q.add_argument("job", metavar="JOB", help="the job name (CheckpointStore's first argument)")
    q.add_argument("--ram-dir", default=argparse.SUPPRESS, metavar="DIR", help="the RAM directory (default /dev/shm)")
    q.add_argument("--force", action="store_true", help="remove them even so")
    p = sub.add_parser(
        "agent",
        help="the node agent: persist RAM snapshots whose trainer died (one per node, next to torchrun)",
        description="Watch the RAM segments of JOB on this node and, when a committed snapshot's trainer process is "
        "gone before the snapshot reached the local or durable tier, write it there as the store would have: local, "
        "and durable when the step was due there by the store's durable cadence. Run one per node, next to torchrun "
        "(or let CheckpointStore(..., agent=True) start it). Exit status with --once: 0 when nothing is left to do "
        "(or the durable manifest waits for other nodes' agents), 1 when a snapshot could not be persisted.",
    )
    p.add_argument("job", help="the job name the stores were given (CheckpointStore(job, ...))")
    p.add_argument("--local", metavar="DIR", help="the node's local directory (the stores' local=)")
    p.add_argument("--durable", metavar="URL", help="the durable URL (the stores' durable=)")
    p.add_argument("--ram-dir", default="/dev/shm", help="the stores' ram_dir (default /dev/shm)")
    p.add_argument("--storage-options", type=_storage_options, default=argparse.SUPPRESS, metavar="JSON",
                   help="fsspec storage options for the durable URL, as JSON")
    p.add_argument("--once", action="store_true", help="persist what is pending now and exit (scripts, tests)")
    p.add_argument("--keep-ram", action="store_true",
                   help="keep the RAM segments of dead trainers once their steps are persisted (by default an agent "
                   "that exits, with --once or when idle, removes them: a finished job leaves no RAM held)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between looks at the RAM segments (default 2)")
    p.add_argument("--exit-when-idle", action="store_true",
                   help="exit once no CheckpointStore(agent=True) of the job is open on this node and nothing is "
                   "pending (how agent=True runs it)")
    p.add_argument("--linger", type=float, default=60.0, metavar="SECONDS",
                   help="with --exit-when-idle: how long no store may be open before the agent exits and gives "
                   "back the persisted RAM segments (default 60): a crashed job restarting on this node restores "
                   "from them")
    p.add_argument("--lock-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_agent)
    p = sub.add_parser(
        "plan",
        help="the optimal checkpoint interval (Young, Daly) and the expected waste",
        description="The optimal checkpoint interval by Young's approximation and Daly's higher-order formula, "
        "the expected waste (checkpoint overhead, lost work, restart time) and a table of waste against interval.",
    )
    p.add_argument("--ckpt-cost", help="what one checkpoint blocks training for (60s, 1m, ...)")
    p.add_argument("--bench", metavar="JSON", help="take the checkpoint cost from `ckptstore bench --json` output "
                   "(its checkpoint_cost.blocking_s, for its --state-size)")
    p.add_argument("--restart", default="0", help="time from a failure to training again (default 0)")
    _failure_args(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser(
        "simulate",
        help="Monte Carlo of a long job under failures: goodput of checkpoint configurations",
        description="Simulate many runs of a long job with exponential (or Weibull) failures for one or more "
        "checkpoint configurations (interval, blocking cost, restart time, tiers and which failures each survives) "
        "and report goodput with a 95%% confidence interval, side by side.",
    )
    p.add_argument("--interval", help="wall time from one checkpoint's start to the next (e.g. 20m)")
    p.add_argument("--cost", help="what each checkpoint blocks training for (e.g. 20s)")
    p.add_argument("--restart", default="0", help="time from a failure to training again, before reading (default 0)")
    p.add_argument("--tier", action="append", metavar="SPEC",
                   help="NAME[:every=K,latency=D,read=D,survives=crash+node|all] (repeatable; default: durable)")
    p.add_argument("--name", default="configuration", help="label of the --interval/--cost configuration")
    p.add_argument("--config", action="append", metavar="JSON",
                   help='a configuration (or a list of them) as inline JSON or a JSON file: {"name", "interval", '
                   '"cost", "restart", "tiers": ["ram:survives=crash", "durable:every=3,latency=6m"]}')
    p.add_argument("--example", choices=["seed"], help="the seed's production example, side by side")
    _failure_args(p)
    p.add_argument("--work", default="21d", help="training the job needs (default 21d)")
    p.add_argument("--trials", type=int, default=2000, help="simulated runs per configuration (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--weibull", type=float, default=None, metavar="SHAPE",
                   help="Weibull inter-failure times of this shape (same MTBF) instead of exponential")
    p.add_argument("--mix", default=None, help="failure classes and weights (default crash=0.22,node=0.78)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a bar chart of the split (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser(
        "goodput",
        help="goodput of a job from its event log: useful time, checkpoint stalls, lost work, restarts, reloads",
        description="Read event logs (a CheckpointStore(events=True) keeps one in its local directory; "
        "benchmarks/bench_goodput_e2e.py writes one per configuration) and split each one's wall-clock time into "
        "productive time (useful steps x the median step time, and the rest, where the log has step times), checkpoint "
        "stalls, lost work, restart and reload time. Several logs are compared in a table.",
    )
    p.add_argument("root", nargs="+", help="a store's local directory or an events.jsonl file (one or more)")
    p.add_argument("--simulate", action="store_true",
                   help="also replay each log's failures in the simulator, with the costs measured from the log")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a timeline and the split of one log (needs matplotlib)")
    p.add_argument("--step-s", default=None, metavar="S|min",
                   help="count useful steps at this step time for every log (seconds, or 'min': the smallest median "
                        "step of the logs), so that configurations whose steps run slower are not credited for it; "
                        "default: each log's own median step")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON (a list for several logs)")
    p.set_defaults(func=cmd_goodput)
    p = sub.add_parser(
        "bench",
        help="measure each storage tier against this machine's raw ceiling, and recommend tuning",
        description="For each target, time the raw ceiling (memcpy; write+fsync and a cold read; on s3:// "
        "boto3's transfer manager with the promotion's part size and parts in flight and ranged GETs of the ranges a "
        "restore reads, elsewhere an fsspec put/get) next to ckptstore's own tier on the same bytes, sweep write chunk size and concurrency for the "
        "local and durable tiers, and print the checkpoint cost of --state-size for `ckptstore plan`. With no "
        "target, measures RAM and a scratch directory under the current one.",
    )
    p.add_argument("--size", default="1GiB", help="bytes per measured operation (default 1GiB)")
    p.add_argument("--ram", action="store_true", help="RAM: memcpy against staging into the RAM tier")
    p.add_argument("--ram-dir", default="/dev/shm", help="where the RAM tier keeps its slots (default /dev/shm)")
    p.add_argument("--local", metavar="DIR", help="a local directory (a scratch subdirectory is made and removed)")
    p.add_argument("--durable", metavar="URL", help="an fsspec URL for the durable tier (e.g. s3://bucket/prefix)")
    p.add_argument("--peer", action="store_true", help="peer replication against raw gloo (see docs/benchmarks.md)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    p.add_argument("--no-sweep", action="store_true", help="skip the chunk size / concurrency sweep")
    p.add_argument("--sweep-size", help="bytes per sweep measurement (default: the smaller of --size and 256MiB)")
    p.add_argument("--state-size", help="state size for the checkpoint cost (default: --size), e.g. 70GiB")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (usable as CheckpointStore(tuning=OUT))")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG chart (needs matplotlib)")
    p.set_defaults(func=cmd_bench)
    return parser


def _failure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mtbf", default=None, help="mean time between failures of the whole job (3h, 180m, ...)")
    p.add_argument("--observed", nargs=3, default=None, metavar=("COUNT", "DURATION", "GPUS"),
                   help="derive the MTBF from COUNT failures seen over DURATION on GPUS GPUs (e.g. 419 54d 16384)")
    p.add_argument("--failure-rate", type=float, default=None, help="failures per GPU per day (with --gpus)")
    p.add_argument("--gpus", type=float, default=None, help="GPUs of this job (scales --observed / --failure-rate)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointError as exc:
        print(f"ckptstore {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

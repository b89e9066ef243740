"""CheckpointStore: save returns once the snapshot is in RAM; the rest happens in the background.

The store is a front over named parts, each in a module of its own:

- options.py: every argument, checked before anything is created;
- collective.py (package root): the gloo groups of the store, and the one way ranks agree;
- the tiers (tiers/): RAM slots, the local directory, peer replicas, the durable URL;
- pipeline.py: where a save goes, from the trainer's call to every tier;
- restore.py: where a step is chosen on restore, and how it is loaded from any mix of tiers;
- retention.py, replicas.py, goodput/tracker.py: what each tier keeps, the replica check, the
  interval plan and the event log.

In a process group every rank's snapshot is a shard of one sharded, layout-independent
checkpoint: every tier holds ordinary ``load_sharded`` directories.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._aio import LoopThread, run_sync
from .._gc import gc_paused
from ..collective import Group, StoreGroups, store_groups
from ..errors import CheckpointError, InvalidArgumentError
from ..goodput.tracker import GoodputTracker
from ..names import DAMAGED_DIR, PEER_DIR, data_file, step_dir
from ..planning.placement import node_of_ranks, replica_holders, replicas_held
from ..tiers.base import ranks_shown
from ..tiers.directory import DirectoryTier, committed_steps
from ..tiers.peer import PeerTier
from ..tiers.ram import RamTier
from ..tiers.segments import SegmentRecord, inventory, remove_segments
from ..train_state import TrainState
from .agent import AGENT_NICE, agent_running, start_agent
from .exchange import transfers_ended
from .options import MAX_NICE, StoreOptions
from .pipeline import Pipeline, SaveHandle
from .replicas import ReplicaCheck
from .restore import Listing, Restorer

log = logging.getLogger("ckptstore")


class CheckpointStore:
    """Tiered asynchronous checkpoints of one training job (see the module docstring).

    ``job`` names the job's shared-memory segments (letters, digits, '.', '_', '-'). ``local``: the
    node's directory for the local tier (None: off); ``durable``: any fsspec URL (None: off), to which
    every ``durable_every``-th snapshot (and the last one, on close) is promoted; the local tier takes
    every ``local_every``-th snapshot, every promoted or replicated one, and the last one on close
    (the RAM tier covers a crash; a step only RAM holds is lost with a node's reboot); ``keep_local`` and
    ``keep_durable``: steps each tier keeps (None: all). ``ram_budget_bytes`` caps the staging memory
    (default: two snapshots) in ``ram_dir``; each staging slot's memory is reserved there when it is
    made, and a ``ram_dir`` too small for it (Docker's default /dev/shm is 64 MiB) fails that save
    with a StorageError naming the size and the remedies. ``ram_fallback="private"`` stages into
    this process's own memory instead when that happens: saves still reach the local and durable
    tiers, but the RAM tier keeps no copy that another process can see, so a restart after a crash
    restores from the local tier or lower, never from RAM. ``process_group``: in a group every rank saves its
    shard (default: the world, when torch.distributed is initialized). ``policy="skip"`` skips a save
    instead of waiting when every slot is still persisting. ``durable_compression="zstd"``
    compresses the durable tier's chunks.

    ``frozen``: an optional predicate on manifest keys naming tensors that do not change (frozen
    weights in fine-tuning). Their bytes are copied only when their storage or version counter
    moved, and at every ``refresh_every``-th save (writes through ``.data``, numpy or DLPack do not
    bump the version counter), and the tiers keep them in a file of their own that later steps
    link instead of rewriting while its checksums are unchanged.

    ``peer_replicas``: copies of each rank's snapshot kept in the RAM of ranks on other nodes
    (every ``peer_every``-th snapshot; also on their disks with ``peer_to_local``), so a restart
    after a node loss restores without the durable tier. The local tier then also keeps the newest
    step replicated (and those being replicated) beyond ``keep_local``: a node loss takes the lost
    node's replicas of the other nodes' parts, so the surviving nodes' own copies of that step are
    what makes it whole. ``node`` names this rank's node when the
    launcher's environment does not. A peer that does not answer within ``peer_timeout_s`` fails
    only that replication, and replication stops for the run. ``timeout_s`` bounds every other
    collective of the store.

    ``interval`` (seconds, a duration such as ``"20m"``, or ``"auto"`` with ``mtbf``) makes
    :meth:`should_save` answer when to checkpoint; ``"auto"`` plans Daly's optimal interval from the
    cost of a save the store measures (what it blocked, plus the slowdown of the steps its background
    work overlapped) and the MTBF, which the failure history in the event log refines.
    ``events=True`` keeps an append-only event log (saves, restores, restarts) in ``<local>/events.jsonl``
    (or ``events=PATH``) for ``ckptstore goodput``. ``sdc="warn"`` or ``"raise"`` compares the checksums of
    tensors that data-parallel replicas must hold identically, and records any mismatch in the manifest.
    ``durable_timeout_s`` bounds each promotion to the durable tier, retries included (default
    0.9 x ``timeout_s``; in a process group it must be below ``timeout_s``): past it the step fails
    in the durable tier only, with a StorageError (ETIMEDOUT) raised once to the trainer, its RAM
    and local copies stay, and the next promotion starts afresh.
    ``tuning``: bulk-write settings for the local and durable tiers (write chunk size, S3 part size,
    writes in flight) as recommended by ``ckptstore bench --json FILE``: that file's path, or a dict
    of the same shape; they win over the ``CKPTSTORE_S3_*`` environment variables.
    ``agent=True`` starts the node agent (``ckptstore agent``) as a detached process, one per node
    whichever rank's store comes first: when this process dies after ``save`` returned but before
    the snapshot reached the local tier, or the durable tier it was due in, the agent writes it
    there from the RAM tier, so a job rescheduled on other nodes still finds it. It exits once no
    store of the job with ``agent=True`` has been open on the node for 60 s (the environment's
    ``CKPTSTORE_AGENT_LINGER_S``) and nothing is left to persist, keeping the RAM a crashed job
    restarting on the node restores from until then.
    ``background_nice``: how many steps below the trainer's scheduling priority the store's
    background work runs (Linux; 0 to 19): the threads that hash, write, upload and replicate
    snapshots and the one that maps RAM slots ahead of the saves; the node agent runs 10 steps
    lower still (it finishes what dead trainers left, after the restarted ones' steps). On cores
    that the training step also needs, the step goes first and the snapshot's persistence takes
    longer; 0 (the default) runs them at the trainer's
    priority, which a training step that keeps every core busy needs (persistence lowered there
    falls behind, and a failure then loses more work).

    Every argument is checked before the store creates anything; a failure after that (a process
    group that cannot form, a directory that cannot be swept) releases what was created.
    """

    def __init__(
        self,
        job: str,
        *,
        local: str | os.PathLike[str] | None = None,
        durable: str | None = None,
        durable_every: int = 10,
        keep_local: int | None = 3,
        keep_durable: int | None = None,
        ram_budget_bytes: int | None = None,
        ram_dir: str = "/dev/shm",
        ram_fallback: str | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        policy: str = "block",
        durable_compression: str | None = None,
        frozen: Callable[[str], bool] | None = None,
        refresh_every: int = 10,
        timeout_s: float = 600.0,
        peer_replicas: int = 0,
        peer_every: int = 1,
        node: Any = None,
        peer_timeout_s: float = 60.0,
        peer_to_local: bool = False,
        interval: str | float | None = None,
        mtbf: str | float | None = None,
        events: bool | str | os.PathLike[str] = False,
        sdc: str = "off",
        durable_timeout_s: float | None = None,
        tuning: str | os.PathLike[str] | dict[str, Any] | None = None,
        agent: bool = False,
        background_nice: int = 0,
        local_every: int = 1,
    ) -> None:
        self.options = StoreOptions.from_arguments(
            job, local=local, durable=durable, durable_every=durable_every, keep_local=keep_local,
            keep_durable=keep_durable, ram_budget_bytes=ram_budget_bytes, ram_dir=ram_dir,
            ram_fallback=ram_fallback, storage_options=storage_options, process_group=process_group, policy=policy,
            durable_compression=durable_compression, frozen=frozen, refresh_every=refresh_every, timeout_s=timeout_s,
            peer_replicas=peer_replicas, peer_every=peer_every, node=node, peer_timeout_s=peer_timeout_s,
            peer_to_local=peer_to_local, interval=interval, mtbf=mtbf, events=events, sdc=sdc,
            durable_timeout_s=durable_timeout_s, tuning=tuning, agent=agent, background_nice=background_nice,
            local_every=local_every,
        )
        self.job = job
        self._closed = False
        self._loop: LoopThread | None = None
        self._tracker: GoodputTracker | None = None
        self.ram: RamTier | None = None
        self.peer: PeerTier | None = None
        self._agent_lock: int | None = None  # the stores lock, held shared while this store is open
        self._sweeping: concurrent.futures.Future[None] | None = None  # the durable sweep (rank 0)
        self._held_pending = False  # the newest step held is the node tiers' answer only (_settle)
        try:
            self._start(process_group)
        except BaseException:
            self._release()
            raise

    def _start(self, process_group: Any) -> None:
        opts = self.options
        # What needs no other rank starts before the store's groups (0.2-0.6 s of gloo): rank 0's
        # listing of the durable tier (an object store's client and requests, the longest part of a
        # start) and the mapping of this rank's RAM slots, both in the background.
        self.rank = Group(process_group).rank
        self.durable = (DirectoryTier("durable", opts.durable.url, storage_options=opts.durable.storage_options,
                                      codec=opts.durable.compression, manifest_writer=self.rank == 0, tuning=opts.tuning)
                        if opts.durable.url else None)
        self._loop = LoopThread(nice=opts.background_nice)
        self.ram = RamTier(opts.job, self.rank, ram_dir=opts.ram_dir, slots=2, fallback=opts.ram_fallback,
                           lower={"local": opts.local, "durable": opts.durable.url})
        # Rank 0 lists and sweeps the durable tier in the background while the rest starts (see
        # _start_durable); on the other ranks the durable client is built at its first request.
        listing = None
        if self.durable is not None and self.rank == 0:
            # From the newest step this node holds: the restore asks whether the durable tier holds
            # one at least as new, and no rank's node can hold an older newest step than this one.
            held = self.ram.node_steps() | (committed_steps(opts.local) if opts.local else set())
            listing = self._start_durable(max(held, default=None))
        if self.durable is not None and self.rank != 0:
            # Built meanwhile, by a thread at the trainer's priority: a restored step's promotion
            # or the first one due would otherwise wait for it (s3fs's imports and its client).
            threading.Thread(target=self.durable.warm, name="ckptstore-durable-client", daemon=True).start()
        # Recorded with every committed snapshot: what the node agent persists when this process dies.
        self.ram.store_info = {"local": opts.local is not None, "durable": opts.durable.url is not None,
                               "durable_compression": opts.durable.compression}
        # The slots are mapped off the trainer's path: now those a previous process of this rank
        # left (a restart), after each save the ones the next saves take, made where they do not
        # exist yet (on a job's first start too: its second save mapped its slot on the trainer's
        # thread while the first one's persistence held the cores, 2.7-3.2 s in the crash loop).
        self.ram.prepare_ahead = True
        self.ram.make_ahead = True
        self.ram.background_nice = opts.background_nice
        self.ram.prepare()
        self._groups: StoreGroups = store_groups(process_group, opts.timeout_s, opts.peer.timeout_s)
        trainer = self._groups.trainer
        self.rank, self.world = trainer.rank, trainer.world
        _agree_options(trainer, opts)
        # Which node each rank runs on decides where replicas go: never on the source's node.
        self.nodes = node_of_ranks(trainer.all_gather(_node_identity(opts.peer.node, self.rank)))
        holders = replica_holders(self.nodes, opts.peer.replicas)
        # Of the ranks sharing a local directory (one node), the lowest writes its manifests, sweeps
        # it and applies retention; rank 0 does so for the shared durable URL.
        where = (socket.gethostname(), os.path.realpath(opts.local) if opts.local else None)
        sharing = trainer.all_gather(where)
        local_owner = self.rank == min(r for r, w in enumerate(sharing) if w == where)
        self.local = (DirectoryTier("local", opts.local, manifest_writer=local_owner, tuning=opts.tuning,
                                    node_local=True) if opts.local else None)
        self.peer = PeerTier(opts.job, self.rank, ram_dir=opts.ram_dir, group=self._groups.peer,
                             send_to=holders[self.rank], hold_for=replicas_held(holders, self.rank),
                             local_root=opts.local, to_local=opts.peer.to_local, keep=opts.keep_local,
                             durable=opts.durable.url)
        self._sweep(local_owner)
        trainer.all_gather(None)  # nobody saves into a directory another rank is still sweeping
        if opts.agent:
            # After the local sweep: an agent started earlier must not find a half-swept directory.
            self._agent_lock, _ = start_agent(opts.job, ram_dir=opts.ram_dir, local=opts.local,
                                              durable=opts.durable.url,
                                              storage_options=opts.durable.storage_options,
                                              nice=min(MAX_NICE, opts.background_nice + AGENT_NICE))
        self._tracker = GoodputTracker(interval=opts.goodput.interval, mtbf_s=opts.goodput.mtbf_s,
                                       events=opts.goodput.events, rank=self.rank, world=self.world, job=opts.job,
                                       local=opts.local, loop=self._loop)
        check = ReplicaCheck(opts.goodput.sdc, self.rank, self.world, self._groups.fast.group_ranks)
        self._pipeline = Pipeline(opts, self._groups, ram=self.ram, local=self.local, peer=self.peer,
                                  durable=self.durable, local_owner=local_owner, check=check, tracker=self._tracker,
                                  loop=self._loop, local_single=len(set(sharing)) == 1)
        node_tiers = [t for t in (self.ram, self.local, self.peer) if t is not None]
        self._restorer = Restorer(opts.job, self._groups, node_tiers, self.durable, check, opts.peer.timeout_s,
                                  durable_listing=listing)
        # A new store takes up where the job's tiers left off: steps only grow past the newest one
        # any tier holds (a committed step is never saved again), and the promotion and replication
        # cadence counts on from it, so a job that keeps crashing still reaches the durable tier.
        # The constructor does not wait for the durable tier's listing (an object store's client and
        # requests: most of a start): the node tiers answer now, and the first collective call
        # (restore, once it loaded the nodes' newest step; save; latest_step) completes the answer.
        newest, self._held_pending = self._restorer.newest_held(wait=False)
        self._resume_from(newest)
        if newest is not None:
            # Resuming: a crash loop repeats this start, so the slots a node agent released are
            # made again off the trainer's path, the first save's now and the next after it.
            self._prepare_first_slot(newest[0])

    def _prepare_first_slot(self, step: int) -> None:
        """Make the first save's slot in the background when this node has none of this rank's
        segments left (a node agent released them after persisting what the crashed process left,
        or the node was replaced): its size is that of this rank's local data file of ``step``,
        which holds the slot's bytes, and the restore of that step, then training, run meanwhile.
        A state that changed size since is staged into a slot the save resizes, as it would be."""
        opts = self.options
        if opts.local is None:
            return
        try:
            size = os.path.getsize(os.path.join(opts.local, step_dir(step), data_file(self.rank)))
        except OSError:
            return  # a replaced node: the restore finds the size (_prepare_slot_as_restored)
        self._prepare_next_slot(size)

    def _prepare_next_slot(self, size: int) -> None:
        assert self.ram is not None
        budget = self.options.ram_budget_bytes
        if budget is None or size <= budget:
            self.ram.prepare(size, only_next=True)

    def _prepare_slot_as_restored(self) -> None:
        """Make the next save's slot in the background at the size of this rank's data file of the
        step just restored, read wherever it was: on a replaced node no local file said it at the
        start, and the first save after every node loss waited while its slot was mapped (1.0-1.6 s
        of the crash loop's checkpoint time at 550 MB a rank). A slot made already is left alone, and
        a store that saved already keeps the sizes its own saves set (a restore after a failed
        save must not leave a slot of the restored size behind in a RAM directory short of room)."""
        size = self._restorer.own_file_size
        if size is not None and self.ram is not None and not self.ram.staged_any:
            self._prepare_next_slot(size)

    def _resume_from(self, newest: tuple[int, dict[str, Any], bool] | None) -> None:
        if newest is not None:
            step, meta, in_durable = newest
            self._pipeline.last_step = step
            self._pipeline.resume(meta, durable_holds_it=in_durable)

    def _settle(self) -> None:
        """The newest step held, with the durable tier's listing, when the constructor answered
        without it (collective: every rank decided alike from rank 0's word)."""
        if self._held_pending:
            self._held_pending = False
            self._resume_from(self._restorer.newest_held()[0])

    def _agents(self) -> bool:
        """Whether node agents of this job may be writing to its tiers: the job runs them, or one
        (``ckptstore agent``, started by hand) runs on this node."""
        return self.options.agent or agent_running(self.options.job, self.options.ram_dir)

    def _sweep(self, local_owner: bool) -> None:
        if self.local is not None and local_owner:
            # A node agent left running by the crashed process (it lingers) may be writing a step here.
            run_sync(self.local.sweep(agents=self._agents()))

    def _start_durable(self, since: int | None) -> concurrent.futures.Future[Listing | None]:
        """List the durable tier's committed steps (from step ``since`` on), then sweep what crashed
        saves left there, in the background (rank 0, which sweeps the shared URL): a start no
        longer waits for an object store's client, listing and deletions. Returns the listing
        (None when it cannot be made), which the restore and the newest step held wait for.

        What the sweep removes lies in step directories listed before this store wrote anything,
        and a step of this run may reuse one of their numbers (after a rollback), so nothing of this
        store reaches the durable tier before the sweep ended: rank 0 waits for it before its first
        save's vote, a restored step's promotion and the close, each of which every rank joins
        before it writes there (:meth:`_swept`)."""
        durable = self.durable
        assert durable is not None and self._loop is not None
        if self.options.background_nice > 0 and "://" in durable.root:
            # fsspec's I/O thread (the client's event loop) starts with the priority of whichever
            # thread first needs it: the trainer's, not a lowered worker's. It parses the client's
            # requests and answers holding the GIL, which a low-priority thread must not.
            import fsspec.asyn

            fsspec.asyn.get_loop()
        listed: concurrent.futures.Future[Listing | None] = concurrent.futures.Future()
        agents = self._agents()

        async def run() -> None:
            try:
                try:
                    listed.set_result(Listing(frozenset(await durable.steps(since=since)), since))
                except (CheckpointError, OSError) as exc:
                    log.warning("ckptstore: cannot list the durable tier: %s", exc)
                    listed.set_result(None)
                await durable.sweep(agents=agents)
            except Exception as exc:  # noqa: BLE001 - housekeeping: an unreachable store must not stop a start
                log.warning("ckptstore: cannot sweep the durable tier %s (what a crashed save left stays until the "
                            "next start): %s", durable.root, exc)
            finally:
                if not listed.done():
                    listed.set_result(None)

        self._sweeping = self._loop.submit(run())
        return listed

    def _swept(self) -> None:
        """Wait for the durable sweep this store started (rank 0; at once elsewhere and later on)."""
        sweeping, self._sweeping = self._sweeping, None
        if sweeping is not None:
            concurrent.futures.wait([sweeping])

    # ------------------------------------------------------------------------------ saving

    @gc_paused
    def save(self, step: int, state: Any) -> SaveHandle:
        """Stage ``state`` in RAM (the only blocking part) and persist it in the background.

        In a process group every rank calls ``save`` with the same step. With ``policy="skip"``
        a save that finds no free slot returns a skipped handle (counted in ``skipped``) instead
        of waiting; all ranks skip together. A background failure of an earlier step is raised
        here (once), with its original class.
        """
        self._check_open()
        self._settle()
        self._swept()
        self._restorer.forget_listing()
        return self._pipeline.save(step, state)

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint at ``step``, under ``interval``: call it once per training step.

        The answer compares ``step`` with the next save step that every rank computed at the last
        ``save`` from the same numbers (rank 0's measured step time, cost per save and MTBF estimate,
        carried by the per-save vote), so all ranks get the same answer without a collective per step.
        The first call says yes: that checkpoint measures the cost cold, and the next two follow a step
        apart to measure it warm (a process's first save also pays one-time costs); from then on the
        plan holds, recomputed at every save."""
        assert self._tracker is not None
        return self._tracker.should_save(step)

    # ------------------------------------------------------------------------------ restoring

    @gc_paused
    def restore(self, state: Any, *, step: int | None = None, per_rank: str = "error",
                resume: bool = True) -> int | None:
        """Load the newest step with a sound copy into ``state`` in place, or exactly ``step``.

        Returns the step loaded; None when no tier holds any checkpoint of this job, or when every
        step held is incomplete (never with ``step``). A step is incomplete when a part of it was
        written by a rank whose node now holds nothing of the step (a node lost before the part
        reached a peer or the durable tier) and no node nor the durable tier has it: it is skipped
        with a warning, as older steps are tried. Raises CorruptCheckpointError (listing what was
        tried) when checkpoints exist but none has a sound copy for every rank and some were
        damaged; with ``step``, CheckpointNotFoundError when no tier of any rank holds it, and
        CorruptCheckpointError when it cannot be loaded. Collective: every rank calls it.

        Without ``step``, every step newer than the one loaded (or all, on a fresh start) is a dead
        branch, whatever kept it from loading: every rank removes its copies of them from every
        tier, RAM, peer, local and durable, before this returns (a warning names them; a damaged
        step's local copy is moved to ``<local>/damaged/`` for inspection instead), and
        :attr:`last_step` becomes the step loaded, so the job saves any step after it, those step
        numbers included, and no later restore returns an old copy. A step that cannot be removed
        from some tier still counts, and saves must go past it. With ``step``, nothing is removed
        and saves still go past the newest step held.

        ``state`` is a state dict (tensors filled in place, other leaves replaced) or a
        :class:`~ckptstore.TrainState` (every part restored, the RNG states last).
        ``per_rank="skip"`` keeps the current per-rank values (RNG states, per-rank loader
        positions) when the checkpoint was saved at another world size.

        ``resume=False`` reads a step without acting on the store, for an export or an evaluation
        of the job's steps: a fallback past newer steps removes nothing (only the training job's
        own restore decides what is a dead branch), and :attr:`last_step`, the durable cadence and
        the tiers stay as they were."""
        self._check_open()
        if per_rank not in ("error", "skip"):
            raise InvalidArgumentError(f"per_rank={per_rank!r}: use 'error' or 'skip'")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise InvalidArgumentError(f"step must be a non-negative int (or None for the newest), not {step!r}")
        if not isinstance(resume, bool):
            raise InvalidArgumentError(f"resume must be True or False, not {resume!r}")
        return self._restore_state(state, step, per_rank, resume=resume)

    def _restore_state(self, state: Any, step: int | None, per_rank: str, *, resume: bool) -> int | None:
        if not isinstance(state, TrainState):
            return self._restore(state, step, per_rank, resume=resume)
        # Building the skeleton initialises a fresh optimizer's state (DCP's helpers take a
        # zero-learning-rate step); with nothing to restore, that must not stay behind, or the
        # run would differ from one that never called restore.
        fresh = [opt for opt in state.all_optimizers() if not opt.state]
        skeleton = state.skeleton()
        found: int | None = None
        try:
            found = self._restore(skeleton, step, per_rank, resume=resume)
        finally:
            if found is None:
                for opt in fresh:
                    opt.state.clear()
        if found is not None:
            state.load_skeleton(skeleton)
        return found

    def _restore(self, state: Any, step: int | None, per_rank: str, *, resume: bool = True) -> int | None:
        assert self._tracker is not None
        t0 = time.perf_counter()
        self._pipeline.drain()
        if step is None:
            result = self._restorer.newest(state, per_rank)
            self._settle()  # after the restore took the durable listing: it is known by then
            last = self._pipeline.last_step
            found, tiers = result.step, result.tiers
            if result.newer and resume:
                # The job goes on from the step loaded: every newer step held is a dead branch,
                # whatever kept it from loading (a part lost with a node, damaged bytes, a copy that
                # could not be read), and its numbers are the new branch's to save. Only a step some
                # tier still holds (its removal failed) keeps counting: a new save of it beside the
                # old copy could be shadowed by it, or mixed with it, on a later restore.
                kept = self._drop_dead_branch(result.newer, found, incomplete=result.dead, damaged=result.damaged)
                last = max(kept, default=found)
                self._restorer.forget_listing()  # the durable listing it kept named what is gone now
                if found is None:
                    self._pipeline.last_step = last
                    self._pipeline.resume({}, durable_holds_it=False)  # the cadence was the dead branch's
        else:
            self._settle()
            last = self._pipeline.last_step
            found, tiers = step, self._restorer.exact(state, step, per_rank)
        seconds = round(time.perf_counter() - t0, 6)
        if found is None:
            self._tracker.event("restore", step=None, tier=None, seconds=seconds)
            return None
        log.info("ckptstore: restored step %d from the %s tier", found, tiers)
        if not resume:
            return found
        self._pipeline.last_step = found if last is None else max(last, found)
        self._tracker.event("restore", step=found, tier=tiers, seconds=seconds)
        self._prepare_slot_as_restored()
        meta, in_durable = self._restorer.meta_of(found)
        self._pipeline.resume(meta, durable_holds_it=bool(in_durable))
        # Only a promotion the dead process owed: the step was due in the durable tier by its cadence
        # and the tier lacks it (the process died during its upload). A step that was not due waits
        # for the cadence, which counts on from its manifest, as it would have without the failure:
        # uploading every restored step made each restart of a crash loop pay a whole extra upload
        # (an object store's CPU on the trainers' cores, when the next steps need them most). During
        # an outage (not listed) nothing is known, and the next regular promotion goes on.
        if self.durable is not None and in_durable is False and _owed_promotion(meta):
            self._swept()
            self._pipeline.promote_restored(found, meta)
        return found

    def _drop_dead_branch(self, dead: list[int], restored: int | None, *, incomplete: list[int],
                          damaged: list[int]) -> list[int]:
        """Remove every copy of ``dead``, the steps newer than the one restored (all of them when
        none was), from every tier: this rank's RAM slots and the peer replicas it holds, its node's
        local directory and replicas on disk (by the rank that owns that directory), and the durable
        tier (rank 0). Returns the steps some rank could not remove from a tier that holds them
        (the same list on every rank): they still count as saved. Collective: no rank saves before every tier is
        clean, so no new copy of a step lies beside an old one, and a crash meanwhile restarts from
        the restored step, or from an old copy when nothing of the new branch was committed yet.

        The restored step and older ones are never touched. ``incomplete``: those of ``dead`` the
        restore found incomplete (a part lost with a node); ``damaged``: those it found damaged (a
        checksum mismatch, a replica check that refused the step), whose local copy is evidence for
        whoever investigates: it is moved aside (:meth:`_set_aside`), not deleted. The others failed
        otherwise (a copy that could not be read)."""
        owner = self.local is not None and self.local.manifest_writer
        ram, peer, durable = self.ram, self.peer, self.durable
        assert ram is not None and peer is not None
        listings: list[tuple[str, Callable[[], set[int]], Callable[[int], None]]] = [
            ("ram", lambda: set(ram.steps_sync()), ram.remove_sync),
            ("peer", lambda: {doc["step"] for _src, doc in peer.replicas()}, peer.remove_sync),
        ]
        if owner:
            assert self.local is not None
            local = self.local

            def drop_local(step: int) -> None:
                if step in damaged:
                    self._set_aside(step)
                else:
                    local.remove_sync(step)

            listings += [("local", local.node_steps, drop_local),
                         ("peer replicas on disk", peer.disk_steps, peer.remove_from_disk)]
        if durable is not None and durable.manifest_writer:
            self._swept()  # the start's sweep of the durable tier, over before anything is removed there
            # Listed from the oldest dead step on: on an object store each step is a request.
            listings.append(("durable", lambda: set(run_sync(durable.steps(since=min(dead)))), durable.remove_sync))
        dropped: list[str] = []
        failed: set[int] = set()
        for name, listed, remove in listings:
            try:
                held = sorted(set(dead) & listed())
            except (CheckpointError, OSError) as exc:
                # Nothing known to be there (the durable tier in an outage, which the restore could
                # not list either): the job goes on; a copy there would make the new save of that
                # step fail in that tier, which says so, rather than stop the job now.
                log.warning("ckptstore: cannot list the %s tier to drop steps %s, newer than the one restored, from "
                            "it: a copy of one of them there stays, and a new save of that step may fail there: %s",
                            name, dead, exc)
                continue
            for step in held:
                try:
                    remove(step)
                except (CheckpointError, OSError) as exc:
                    log.warning("ckptstore: cannot drop step %d, newer than the one restored, from the %s tier: it "
                                "still counts as saved, and the job saves only steps after it: %s", step, name, exc)
                    failed.add(step)
                    continue
                dropped.append(f"step {step} in {name}")
        if dropped:
            what = f"step {dead[0]}" if len(dead) == 1 else "steps " + ", ".join(map(str, dead))
            why = ("incomplete" if set(dead) <= set(incomplete)
                   else "could not be restored" if not incomplete
                   else f"could not be restored ({', '.join(map(str, incomplete))} incomplete)")
            log.warning("ckptstore: %s %s (%s): a dead branch; rank %d dropped its copies (%s), so that the job "
                        "can save %s again", what, why,
                        "no step could be" if restored is None else f"the restore loaded step {restored}", self.rank,
                        ", ".join(dropped), "that step" if len(dead) == 1 else "those steps")
        if self.world == 1:
            return sorted(failed)
        return sorted(set().union(*map(set, self._groups.trainer.all_gather(sorted(failed)))))

    def _set_aside(self, step: int) -> None:
        """Move this node's local copy of a damaged dead step to ``<local>/damaged/`` under a name of
        its own (one rename: the step leaves the tier whole), where no store reads, sweeps or
        removes it: the bytes a checksum or replica check refused stay for whoever investigates."""
        root = self.options.local
        assert root is not None
        aside = os.path.join(root, DAMAGED_DIR)
        os.makedirs(aside, exist_ok=True)
        where = os.path.join(aside, f"{step_dir(step)}.{time.time_ns()}")
        os.rename(os.path.join(root, step_dir(step)), where)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # the step leaves the tier for good: a power loss must not bring it back
        finally:
            os.close(fd)
        log.warning("ckptstore: the local copy of step %d, damaged, is kept for inspection in %s (no store reads or "
                    "removes it; delete it when done)", step, where)

    def latest_step(self) -> int | None:
        """The newest step any tier of any rank holds committed, without loading it (collective);
        None when there is none. A restarted job resumes numbering after it."""
        self._check_open()
        self._pipeline.drain()
        self._settle()
        return self._restorer.latest()

    # ------------------------------------------------------------------------------ closing

    def close(self, *, keep_ram: bool = False) -> None:
        """Drain the pipeline, promote the last snapshot if it was not, and stop the loop.
        Re-raises a background failure that nothing surfaced yet.

        Then this rank's RAM segments (its staging slots, and the peer replicas it holds) leave
        ``ram_dir``: their memory belongs to the node, and stays taken after the process exits
        until someone removes them. The slots go once their newest step is committed at a lower
        tier (local or durable), a replica once the durable tier (or this node's disk, with
        ``peer_to_local``) holds its step. ``keep_ram=True`` keeps them all, for a restart on this
        node that restores from RAM. A store without a local or durable tier keeps them in any case
        (they are the only copy), and says so in a warning, as it does for any it keeps because
        their step reached no lower tier; ``ckptstore ram`` lists what is left, ``ckptstore ram rm
        JOB`` removes it.

        Leaving a ``with`` block on an exception closes this rank alone: no agreement with the
        other ranks (they may never close), so the last snapshot is not promoted here (a restart
        promotes a step whose promotion was due), and a failure of the close is logged instead of
        hiding the exception."""
        self._close(keep_ram=keep_ram, agree=True)

    def _close(self, *, keep_ram: bool, agree: bool) -> None:
        if self._closed:
            return
        try:
            self._swept()
            self._pipeline.close(agree=agree)
            if not keep_ram:
                assert self.ram is not None
                self.ram.stop_preparing()  # a segment made after the listing below would stay behind
                self._release_ram()
        finally:
            self._release()
        self._pipeline.errors.raise_pending(self._pipeline.errors.pending())

    def _release_ram(self) -> None:
        """Remove this rank's segments whose steps exist at a lower tier (see :meth:`close`)."""
        opts = self.options
        try:
            records = [r for r in inventory(opts.ram_dir, self.job, owners=False) if r.rank == self.rank]
        except CheckpointError as exc:
            log.warning("ckptstore: cannot list the RAM segments of job %s to release them: %s", self.job, exc)
            return
        if not records:
            return
        newest = max((r.step for r in records if r.src is None and r.step is not None), default=None)
        local = self._listed(self.local)
        # The durable tier is listed only when the answer depends on it (a request to an object store).
        covered = newest is None or max(local or set(), default=-1) >= newest
        replicas = any(r.src is not None and r.step is not None for r in records)
        durable = self._listed(self.durable) if replicas or not covered else None
        peer_disk = (committed_steps(os.path.join(opts.local, PEER_DIR))
                     if self.peer is not None and self.peer.to_local and opts.local else set())
        lower = max((local or set()) | (durable or set()), default=None)
        if self.local is None and self.durable is None:
            own_kept = "the store has no local or durable tier, so they are the only copy of their steps"
        elif lower is None or (newest is not None and lower < newest):
            own_kept = f"step {newest} is committed at no lower tier"
        else:
            own_kept = ""
        replicas_at = max((durable or set()) | peer_disk, default=-1)
        go: list[SegmentRecord] = []
        kept: list[SegmentRecord] = []
        reasons: set[str] = set()
        for r in records:
            if r.step is None:
                why = ""  # nothing committed in it: no restore could use it
            elif r.src is None:
                why = own_kept
            else:
                why = "" if replicas_at >= r.step else f"the durable tier lacks the replicas' step {r.step}"
            (kept if why else go).append(r)
            if why:
                reasons.add(why)
        try:
            remove_segments(go)
        except CheckpointError as exc:
            log.warning("ckptstore: cannot release the RAM segments of job %s: %s", self.job, exc)
        if kept:
            size = sum(r.size for r in kept)
            where = "" if opts.ram_dir == "/dev/shm" else f" --ram-dir {opts.ram_dir}"
            log.warning("ckptstore: close() keeps %d RAM segment%s of job %s, rank %d (%.1f MiB in %s): %s. A restart on "
                        "this node restores from them; `ckptstore ram rm %s%s` frees them (close(keep_ram=True) keeps "
                        "them without this warning)", len(kept), "" if len(kept) == 1 else "s", self.job, self.rank, size / (1 << 20), opts.ram_dir,
                        "; ".join(sorted(reasons)), self.job, where)

    def _listed(self, tier: DirectoryTier | None) -> set[int] | None:
        """The committed steps of ``tier``; None without one or when it cannot be listed (then it
        counts as holding nothing, and the segments stay)."""
        if tier is None:
            return None
        try:
            return set(tier.steps_sync())
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore: cannot list the %s tier while closing (the RAM segments it would let go stay): %s",
                        tier.name, exc)
            return None

    def _release(self) -> None:
        self._closed = True
        if self._tracker is not None:
            self._tracker.close()  # its last records go out on the loop, before the loop stops
        idle = self._loop.close() if self._loop is not None else True
        for tier in (self.ram, self.peer):
            if tier is not None:
                tier.close()
        if self._agent_lock is not None:
            os.close(self._agent_lock)  # the agent exits once no store holds it and nothing is pending
            self._agent_lock = None
        groups = getattr(self, "_groups", None)
        if groups is None or groups.world == 1:
            return
        # The caller tears its process group down next (destroy_process_group() shuts down every
        # group, ours too): ours go first, but only once no thread of ours is in a transfer or
        # collective on them, since a gloo group shut down under one aborts the process.
        if idle and transfers_ended(self.options.timeout_s):
            groups.release()
        else:
            log.warning("ckptstore: a transfer of this store is still running on its process groups after close(); "
                        "they are left to it, and a destroy_process_group() before it ends may abort the process")

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointStore is closed")

    def _drain(self) -> None:
        self._pipeline.drain()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.close()
            return
        # This rank is leaving on an exception. The other ranks may never reach close() (an elastic
        # agent takes them down once this process exits), so no collective runs here: close()'s
        # agreement on the last promotion would hold this rank for up to timeout_s (10 minutes by
        # default) and delay the restart by as much. The pipeline still drains, since the other
        # ranks' background work goes on without their trainers. A failure of the close is logged,
        # not raised: the caller's exception is the one to see.
        try:
            self._close(keep_ram=False, agree=False)
        except Exception as failure:  # noqa: BLE001 - logged, the exception in flight goes on
            log.error("ckptstore: closing rank %d's store of job %s after %s: %s", self.rank, self.job,
                      type(exc).__name__, failure)

    # ------------------------------------------------------------------------------ what it is

    @property
    def last_step(self) -> int | None:
        """The newest step this store saved or restored (steps only grow, but a ``restore()`` that
        falls back to an older step, removing the newer ones, counts on from it), else the newest
        one the tiers held at its start; None when there is none. The constructor does not wait for the
        durable tier's listing: in a process group, until the first restore, save or latest_step
        (collective calls, which take it in), the durable tier counts here only if its listing had
        come back by the end of the constructor; a single process takes it in here."""
        if self._held_pending and self.world == 1:
            self._settle()
        return self._pipeline.last_step

    @property
    def skipped(self) -> int:
        """Saves ``policy="skip"`` dropped."""
        return self._pipeline.skipped

    @property
    def plan(self) -> dict[str, Any] | None:
        """The newest interval plan (``interval=``), for the curious."""
        return self._tracker.plan if self._tracker is not None else None

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, over the store's own gloo group: for
        adapters that agree on something before a save (collective; ``[obj]`` in one process)."""
        return self._groups.trainer.all_gather(obj)


def _node_identity(node: Any, rank: int) -> Any:
    """This rank's node: ``node=``, else the launcher's (torchrun's GROUP_RANK, NODE_RANK, or the rank
    divided by LOCAL_WORLD_SIZE), else the host name."""
    if node is not None:
        return node
    for var in ("GROUP_RANK", "NODE_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return rank // int(local)
    return socket.gethostname()


def _owed_promotion(meta: dict[str, Any]) -> bool:
    """Whether a step's manifest says it was due in the durable tier: its cadence counted no save
    since the last promotion (the step was that promotion). A manifest without a cadence (an older
    writer) cannot say, and is promoted as before."""
    cadence = meta.get("cadence")
    if not isinstance(cadence, dict):
        return True
    count = cadence.get("durable")
    return not isinstance(count, int) or isinstance(count, bool) or count == 0


def _collective_options(opts: StoreOptions) -> dict[str, Any]:
    """The options that decide which collectives a save runs (which tiers it writes, how often, the
    replica check): ranks that differ in one would wait for each other in different collectives
    until the group's timeout."""
    return {"local": opts.local is not None, "local_every": opts.local_every, "durable": opts.durable.url is not None,
            "durable_every": opts.durable.every, "peer_replicas": opts.peer.replicas, "peer_every": opts.peer.every,
            "sdc": opts.goodput.sdc, "policy": opts.policy}


def _agree_options(group: Group, opts: StoreOptions) -> None:
    """Refuse, on every rank alike, options that differ between ranks (:func:`_collective_options`):
    one all-reduce of a digest and its negation, whatever the number of ranks; only a difference
    gathers every rank's options, to name them."""
    if group.world == 1:
        return
    mine = _collective_options(opts)
    digest = int.from_bytes(hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).digest()[:7], "little")
    top, bottom = group.max_int64([digest, -digest])
    if top == -bottom:
        return
    every = group.all_gather(mine)
    differ = []
    for name in mine:
        by_value: dict[str, list[int]] = {}
        for rank, options in enumerate(every):
            by_value.setdefault(repr(options[name]), []).append(rank)
        if len(by_value) > 1:
            differ.append(f"{name} is " + " but ".join(f"{v} on rank{'s' if len(r) > 1 else ''} {ranks_shown(r)}"
                                                       for v, r in by_value.items()))
    raise InvalidArgumentError("CheckpointStore options differ between the ranks of its process group: "
                               + "; ".join(differ) + ". Every rank must pass the same (which tiers, how often, "
                               "the replica check and the save policy decide the collectives each save runs)")

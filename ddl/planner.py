"""Choosing a schedule: build every applicable algorithm, predict, pick the fastest, cache.

The planner is pure (no MPI, no GPU) and deterministic. For a collective of ``nbytes`` on a topology
it builds each registered algorithm's schedule (but not one that can only repeat another candidate's
there, :data:`ddl.algorithms.REDUNDANT`), predicts its time with the simulator, and picks the
fastest (ties go to the algorithm registered first, which lists the simpler ones first); on the flat
network assumed without a topology file, which charges nothing per message, the one of fewest
messages among those predicted within :data:`FLAT_MESSAGE_MARGIN` of the fastest. The answer also
reports the lower bound, so every choice comes with its distance from the optimum.

A candidate's simulation stops as soon as it provably cannot beat the fastest one simulated so far
(:class:`ddl.simulate.Outpaced`: the simulated time plus the bytes a link has yet to carry exceeds it);
the plan then reports how slow it is at least. The choice is the same as with every simulation run
to its end, since only strictly slower candidates are stopped. ``exhaustive=True`` runs them all out,
for comparison tables.

Schedules depend on the message size only through the choice of algorithm and its pipelining depth, so
plans are cached by *size class* (the power of two at or above ``nbytes``): in memory per
:class:`Planner`, and on disk under ``$DDL_CACHE_DIR`` (default ``~/.cache/ddl``) keyed by the topology
fingerprint and the planner's revision, so a training step never plans twice, a restarted job starts
with its plans, and plans chosen by an older cost model are not reused. A rank that finds no plan on
disk plans under a lock that the other ranks of its node wait on, and they load its plan instead of
all computing the same plan at once on the node's cores.
"""
import hashlib
import math
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .errors import PlanError, ScheduleError
from .schedule import COLLECTIVES, Schedule, gc_paused, write_file
from .settings import env_flag
from .simulate import Outpaced, simulate, simulated
from .units import counted, message_size
from .verify import Abandoned, verify

AUTO = "auto"
# Candidates with fewer operations than this in all are simulated in this process: forking costs more.
PARALLEL_MIN_OPS = 100_000
# Bump when the cost model or an algorithm changes which schedule a size class gets (the set of
# registered algorithms is part of the cache key anyway).
PLANNER_REVISION = 22
# How long a rank waits for another process to finish the plan it needs before planning it itself (a
# holder stopped in a debugger must not stop the job for good).
PLAN_WAIT_SECONDS = 600.0


@dataclass(frozen=True)
class Plan:
    """A chosen schedule with its prediction, bound and the alternatives it beat."""

    collective: str
    nbytes: int
    algorithm: str
    schedule: Schedule
    predicted_seconds: float
    bound_seconds: float
    bandwidth_bound_seconds: float
    latency_bound_seconds: float
    baselines: dict = field(default_factory=dict)
    verified: bool = False
    reason: str = ""
    busiest: tuple = ()
    skipped: dict = field(default_factory=dict)   # algorithm -> why it was not planned here
    outpaced: dict = field(default_factory=dict)  # algorithm -> at least this many seconds (not run out)

    @property
    def gap(self):
        """Predicted time over the lower bound (1.0 = optimal)."""
        return self.predicted_seconds / self.bound_seconds if self.bound_seconds > 0 else 1.0

    def __str__(self):
        """What ``print(comm.explain(n))`` shows: the choice, why, its prediction against the bound
        and the alternatives it beat (``ddl plan`` prints the same with the topology's details)."""
        from .units import format_seconds, format_size

        sched = self.schedule
        lines = [f"{self.collective} of {format_size(self.nbytes)}: {self.algorithm} "
                 f"({'verified' if self.verified else 'NOT verified'}: {sched.nchunks} chunks, {sched.nops} operations)",
                 f"why        {self.reason}" if self.reason else None,
                 f"predicted  {format_seconds(self.predicted_seconds)}   bound {format_seconds(self.bound_seconds)}"
                 f"   gap {self.gap:.3f}x"]
        for name, secs in sorted(self.baselines.items(), key=lambda kv: kv[1]):
            lines.append(f"  vs {name:<22} {format_seconds(secs):>10}")
        for name, secs in sorted(self.outpaced.items(), key=lambda kv: kv[1]):
            lines.append(f"  vs {name:<22} >{format_seconds(secs):>9}   (stopped once it could not win)")
        return "\n".join(line for line in lines if line is not None)


FLAT_BANDWIDTH = "10 GB/s"
# The source of that assumed network (see flat_topology).
FLAT_SOURCE = "<flat>"
# On it, `auto` takes the candidate that sends the fewest messages among those predicted within this
# part of the fastest: the assumed network charges nothing per message, yet every message costs the
# executor real time, and on one host, where the ranks' own cores copy the bytes, more than the
# differences it predicts (8 ranks on 2 cores, 64 MiB: reduce-broadcast-trees with 3584 messages,
# predicted 15% faster than halving-doubling with 576, measured 1.4-1.9x slower).
FLAT_MESSAGE_MARGIN = 0.25


def flat_topology(nranks, bandwidth=FLAT_BANDWIDTH, latency="1 us"):
    """``nranks`` CPU ranks on one switch: what ddl assumes when told nothing about the cluster."""
    from .topology import Topology

    nodes = [{"id": "switch", "kind": "switch"}] + [{"id": f"rank{i}", "kind": "cpu"} for i in range(nranks)]
    links = [{"a": f"rank{i}", "b": "switch", "bandwidth": bandwidth, "latency": latency} for i in range(nranks)]
    return Topology.from_dict({"name": f"flat-{nranks}", "nodes": nodes, "links": links,
                               "ranks": [f"rank{i}" for i in range(nranks)]}, source=FLAT_SOURCE)


def size_class(nbytes):
    """The power of two at or above ``nbytes``: plans are shared within a class."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def _cache_generation():
    """Folder name of this planner's plans: its revision and the algorithms it chooses among."""
    names = ",".join(algorithm_names())
    return f"plans-r{PLANNER_REVISION}-{hashlib.sha256(names.encode()).hexdigest()[:8]}"


def algorithm_names():
    from .algorithms import ALGORITHMS

    return list(ALGORITHMS)


def check_algorithm(name):
    """:class:`PlanError` naming the choices unless ``name`` is ``auto`` or an algorithm of ddl's."""
    if name != AUTO and name not in algorithm_names():
        raise PlanError(f"unknown algorithm {name!r}; choose one of: {AUTO}, {', '.join(algorithm_names())}")


class Planner:
    """Plans collectives on one topology, with an in-memory and an on-disk cache."""

    def __init__(self, topo, cache_dir=None, use_disk_cache=None, workers=1):
        """``workers``: processes that build and simulate the candidates of a cold plan (they are
        independent, and simulation, theirs and that of the variants some algorithms choose among, is
        most of a plan's time). More than 1 needs the ``fork`` start method; keep 1 inside MPI jobs,
        where forking a process that holds MPI state is unsafe."""
        self.topo = topo
        self.workers = max(1, int(workers))
        if use_disk_cache is None:
            use_disk_cache = env_flag("DDL_PLAN_CACHE", True)
        base = cache_dir or os.environ.get("DDL_CACHE_DIR") or Path.home() / ".cache" / "ddl"
        base = Path(base).expanduser()
        self.cache_dir = base / _cache_generation() / topo.fingerprint[:16] if use_disk_cache else None
        # why the last plan could not be stored (a read-only or full disk...), for ``ddl plan`` to say
        self.cache_problem = None if use_disk_cache else "the disk cache is off (DDL_PLAN_CACHE)"
        self._schedules = {}
        self._pinned = {}

    def pin(self, schedule):
        """Run ``schedule`` -- a :class:`~ddl.schedule.Schedule`, or the path of one saved with ``ddl
        plan --save`` and perhaps edited by hand -- for every call of its collective (and root, for a
        broadcast) at any size, whatever algorithm is asked for: schedules are size-independent
        templates. It is proved here, so a wrong one fails now with :class:`ddl.ScheduleError`, not
        in the job; one for another rank count is a :class:`ddl.PlanError`. Returns the schedule."""
        source = None
        if not isinstance(schedule, Schedule):
            source = schedule
            try:
                schedule = Schedule.load(schedule)
            except OSError as exc:
                raise ScheduleError(f"{source}: cannot read the schedule ({exc.strerror or exc}); give the path "
                                    f"of a file written by 'ddl plan --save'") from None
        try:
            self._prove_given(schedule)
        except (PlanError, ScheduleError) as exc:
            if source is None:
                raise
            raise type(exc)(f"{source}: {exc}") from None
        self._pinned[_pin_key(schedule.collective, schedule.root)] = schedule
        return schedule

    def evaluate(self, schedule, nbytes, source=None):
        """The :class:`Plan` of a given schedule (one to :meth:`pin`, say; ``source`` names where it
        came from): proved, simulated at ``nbytes`` and set against the lower bound, with no
        alternatives."""
        from .bounds import lower_bound

        if schedule.nranks == self.topo.nranks:    # (else _prove_given says so first)
            nbytes, _ = _check_request(self.topo, schedule.collective, nbytes, schedule.root)
        self._prove_given(schedule)
        sim = simulate(self.topo, schedule, nbytes)
        bound = lower_bound(self.topo, schedule.collective, nbytes, root=schedule.root)
        name = schedule.algorithm or "a schedule"
        reason = f"{name} runs{f' ({source})' if source else ''}" + _regime(sim.seconds, bound)
        return Plan(schedule.collective, nbytes, name, schedule, sim.seconds, bound.seconds, bound.bandwidth_seconds,
                    bound.latency_seconds, verified=True, reason=reason, busiest=tuple(sim.busiest))

    def _prove_given(self, schedule):
        if schedule.nranks != self.topo.nranks:
            raise PlanError(f"the schedule is for {counted(schedule.nranks, 'rank')}; {self.topo.name} has {self.topo.nranks}")
        _verified(schedule)

    # ---- schedules (the hot path for executors) ---------------------------------------------------
    def schedule(self, collective, nbytes, algorithm=AUTO, root=0):
        """The schedule to run for this call; cached, verified once."""
        nbytes, root = _check_request(self.topo, collective, nbytes, root)
        if self._pinned:
            pinned = self._pinned.get(_pin_key(collective, root))
            if pinned is not None:
                return pinned
        key = _key(collective, nbytes, algorithm, root)
        sched = self._schedules.get(key)
        if sched is None:
            with self._turn_to_plan(key) as sched:       # a plan on disk, or None: make it
                if sched is None and algorithm == AUTO:
                    made = self.plan(collective, nbytes, AUTO, root).schedule
                    sched = self._schedules.get(key, made)     # plan() holds the first stored plan
                elif sched is None:
                    sched = self._build(algorithm, collective, size_class(nbytes), root)
                    _verified(sched)
                    sched = self._store(key, sched)
            self._schedules[key] = sched
        return sched

    def pinned(self, collective, root=0):
        """The schedule :meth:`pin` set for this call, or None."""
        return self._pinned.get(_pin_key(collective, root)) if self._pinned else None

    def explain(self, collective, nbytes, algorithm=AUTO, root=0):
        """The :class:`Plan` of what :meth:`schedule` runs for this call: a pinned schedule or the plan
        held for its size class (made for another size, or by another process), evaluated at
        ``nbytes``; else a plan made now, with its alternatives."""
        nbytes, root = _check_request(self.topo, collective, nbytes, root)
        pinned = self.pinned(collective, root)
        if pinned is not None:
            return self.evaluate(pinned, nbytes, source="pinned")
        plan = self.plan(collective, nbytes, algorithm, root)
        held = self._schedules.get(_key(collective, nbytes, algorithm, root))
        if held is not None and held != plan.schedule:
            fresh = f"; a plan made now picks {plan.algorithm}" if plan.algorithm != held.algorithm else ""
            return self.evaluate(held, nbytes, source=f"the plan held for this size class, made at another of "
                                                      f"its sizes or by another process{fresh}")
        return plan

    def stored(self, collective, nbytes, algorithm=AUTO, root=0):
        """The valid schedule the disk cache holds for this call's size class, or None."""
        key = _key(collective, nbytes, algorithm, root)
        return self._load(key, proven=self._schedules.get(key))

    def cache_file(self, collective, nbytes, algorithm=AUTO, root=0):
        """Where the disk cache keeps the schedule of this call (None without a disk cache)."""
        if self.cache_dir is None:
            return None
        return self._path(_key(collective, nbytes, algorithm, root))

    def held(self, collective, nbytes, algorithm=AUTO, root=0):
        """The schedule this planner holds for the call's size class (what :meth:`schedule` returns
        without planning), or None."""
        return self._schedules.get(_key(collective, nbytes, algorithm, root))

    # ---- full plans (with predictions, for users and the CLI) -----------------------------------
    def plan(self, collective, nbytes, algorithm=AUTO, root=0, exhaustive=False):
        """Build, predict and compare; see :class:`Plan`. ``exhaustive``: simulate every candidate to
        its end, even those that provably lose (for tables that compare them). The chosen schedule
        joins both caches, so :meth:`schedule` (what a :class:`ddl.Communicator` runs) finds it for any
        size of its class, unless they hold a plan of that class already: the first plan of a class
        stays, whichever size or process made it, so every job on the topology runs the same one
        (:meth:`held` says which).

        The cyclic garbage collector is paused throughout: the candidates are millions of small
        containers without cycles, and every collection between two builds would walk all those built
        so far again, seconds each at a thousand ranks. The losers are freed by reference counting as
        the plan returns."""
        nbytes, root = _check_request(self.topo, collective, nbytes, root)
        with gc_paused():
            return self._plan(collective, nbytes, algorithm, root, exhaustive)

    def _plan(self, collective, nbytes, algorithm, root, exhaustive):
        from .algorithms import REDUNDANT, TAKES_BEAT
        from .algorithms.tree_packing import MAX_RANKS as PACKING_MAX_RANKS
        from .bounds import lower_bound

        built = {}
        check_algorithm(algorithm)
        skipped, names = {}, []
        for name in ([] if algorithm == AUTO else [algorithm]) + algorithm_names():
            if name in names or name in skipped:
                continue
            redundant = REDUNDANT.get(name) if name != algorithm else None
            if redundant is not None and (why := redundant(self.topo)):
                skipped[name] = why
            else:
                names.append(name)
        prune = algorithm == AUTO and not exhaustive
        margin = FLAT_MESSAGE_MARGIN if self.topo.source == FLAT_SOURCE else 0.0
        # On one core, those that simulate variants of their own and can stop them once they cannot win
        # come second, told the time to beat (the leaf-spine cluster at 256 MiB: 23 s instead of 66 s).
        # With workers they are built beside the others instead, started last and told the fastest time
        # the workers have simulated so far as it falls (see _build_all): alone in a second round, the
        # packing's LP would no longer overlap the other builds (16 GPUs: 20 s instead of 13 s). Only
        # where a packing can be built: the workers' race costs the overlap of the winner's proof with
        # the other simulations (1024 ranks: 43 and 48 s without it, 51 and 53 s with it)
        later = [name for name in names if prune and nbytes and name in TAKES_BEAT and not _can_fork(self.workers, 2)]
        predicted, outpaced, proved = {}, {}, {}
        for group in ([n for n in names if n not in later], later):
            if not group:
                continue
            so_far = min((sim.seconds for sim in predicted.values()), default=math.inf)
            beat = so_far * (1.0 + margin) if group is later and so_far < math.inf else None
            race = prune and nbytes and self.topo.nranks <= PACKING_MAX_RANKS and not TAKES_BEAT.isdisjoint(group)
            made, raced = self._built_group(group, collective, nbytes, root, algorithm, skipped, beat,
                                            1.0 + margin if race else None)
            so_far = min(so_far, raced)
            built.update(made)
            sims, stopped, proofs = _predict(self.topo, made, nbytes, self.workers, prune, 1.0 + margin, so_far)
            predicted.update(sims)
            outpaced.update(stopped)
            proved.update(proofs)
        built = {name: built[name] for name in names if name in built}      # (ties go to the earlier name)
        candidates = {name: (sched, predicted[name]) for name, sched in built.items() if name in predicted}
        if algorithm != AUTO and algorithm not in candidates:
            raise PlanError(f"algorithm {algorithm!r} cannot plan {collective} here: {skipped.get(algorithm)}")
        if not candidates:
            raise PlanError(f"no algorithm can plan {collective} on {self.topo.name}: {skipped}")
        fastest = min(candidates, key=lambda n: candidates[n][1].seconds)
        chosen = algorithm if algorithm != AUTO else _fewest_messages(candidates, fastest, margin)
        sched, sim = candidates[chosen]
        if isinstance(proved.get(chosen), ScheduleError):
            raise proved[chosen]
        verified = proved.get(chosen) is True or _verified(sched)
        bound = lower_bound(self.topo, collective, nbytes, root=root)
        baselines = {n: s.seconds for n, (_, s) in candidates.items() if n != chosen}
        reason = (_explain_fewer(chosen, sim, fastest, candidates[fastest][1], margin, bound)
                  if algorithm == AUTO and chosen != fastest else
                  _explain(chosen, algorithm, sim.seconds, baselines, outpaced, bound, nbytes))
        key = _key(collective, nbytes, algorithm, root)
        # a plan made ahead of a job (``ddl plan``) is found by its ranks; the first stored stays (0 bytes:
        # every algorithm ties, so not the 1-byte class's plan)
        if nbytes > 0 and key not in self._schedules:
            held = self._load(key, proven=sched)
            self._schedules[key] = held if held is not None else self._store(key, sched)
        return Plan(collective, nbytes, chosen, sched, sim.seconds, bound.seconds, bound.bandwidth_seconds,
                    bound.latency_seconds, baselines, verified, reason, tuple(sim.busiest), skipped, outpaced)

    def _built_group(self, names, collective, nbytes, root, algorithm, skipped, beat=None, slack=None):
        """``({name: Schedule}, fastest)`` of ``names`` that built (``fastest``: see :meth:`_build_all`);
        why the others did not goes into ``skipped`` (the requested ``algorithm``'s invalid schedule is
        raised)."""
        built = {}
        made, fastest = self._build_all(names, collective, nbytes, root, beat, slack)
        for name, sched in made.items():
            if isinstance(sched, PlanError):   # said beside its name: once is enough
                skipped[name] = str(sched).removeprefix(f"{name}: ")
            elif isinstance(sched, ScheduleError):   # an algorithm's bug must not stop the others: said, not hidden
                if name == algorithm:
                    raise sched
                skipped[name] = f"built an invalid schedule, a bug to report: {sched}"
            else:
                built[name] = sched
        return built, fastest

    def _build_all(self, names, collective, nbytes, root, beat=None, slack=None):
        """``({name: its Schedule, or the PlanError or ScheduleError that stopped it}, fastest)`` for
        ``names``, in their order. With more than one worker, each is built in a forked process: the
        algorithms that simulate variants of their own to choose among them (tree-packing, Blink's
        trees) take most of a small cluster's plan, each on its own (the leaf-spine cluster at 256 MiB:
        32 s and 19 s of a 56 s plan on one core). ``beat`` (see :data:`ddl.algorithms.TAKES_BEAT`):
        built here, one after the other, as on one core.

        ``slack`` (a plan that stops the candidates that cannot win): the workers also simulate each
        candidate they build, stopped once it exceeds ``slack`` times the fastest time so far, which
        they share, and the algorithms of TAKES_BEAT, started last, are told that time as it falls (a
        packing's variants stop once they cannot win the plan, while the other candidates are still
        built beside it). The simulations stay on the schedules (see :func:`ddl.simulate.simulate`),
        so the planner's own are given at once; ``fastest`` is the least time simulated (infinite
        when none was)."""
        if beat is not None or not _can_fork(self.workers, len(names)):
            return {name: self._built(name, collective, nbytes, root, beat) for name in names}, math.inf
        from .algorithms import TAKES_BEAT

        fastest = multiprocessing.Value("d", math.inf) if slack is not None else None
        order = [n for n in names if n not in TAKES_BEAT] + [n for n in names if n in TAKES_BEAT]
        with _forked_workers(self.workers, len(names), (self, collective, nbytes, root, fastest, slack)) as pool:
            futures = {name: pool.submit(_build_forked, name) for name in order}
            made = {name: futures[name].result() for name in names}
        return made, fastest.value if fastest is not None else math.inf

    def _built(self, name, collective, nbytes, root, beat=None):
        """:meth:`_build`, or the PlanError or ScheduleError it raised."""
        try:
            return self._build(name, collective, nbytes, root, beat)
        except (PlanError, ScheduleError) as exc:
            return exc

    def _build(self, name, collective, nbytes, root, beat=None):
        from .algorithms import ALGORITHMS, TAKES_BEAT

        try:
            fn = ALGORITHMS[name]
        except KeyError:
            raise PlanError(f"unknown algorithm {name!r}; choose one of: auto, {', '.join(ALGORITHMS)}") from None
        if self.topo.nranks == 0:
            raise PlanError("the topology has no ranks")
        if beat is not None and name in TAKES_BEAT:
            return fn(self.topo, collective, root=root, nbytes=nbytes, beat=beat)
        return fn(self.topo, collective, root=root, nbytes=nbytes)

    # ---- disk cache ---------------------------------------------------------------------------
    def _path(self, key):
        collective, root, algorithm, cls = key
        return self.cache_dir / f"{collective}-root{root}-{algorithm}-{cls}.json"

    def _load(self, key, proven=None):
        """The valid plan the disk cache holds for ``key``, or None. A file equal to ``proven``, a
        schedule this process has proved already, is that one, not proved again (about a second at
        192 ranks)."""
        if self.cache_dir is None:
            return None
        collective, root, _algorithm, _cls = key
        try:
            sched = Schedule.load(self._path(key))
        except (OSError, ScheduleError, ValueError):       # ValueError: not text (UnicodeDecodeError)
            return None
        if proven is not None and sched == proven:
            return proven
        if (sched.collective, sched.nranks) != (collective, self.topo.nranks) or (
                collective == "broadcast" and sched.root != root):
            return None        # a file that holds another call's plan is a miss: plan afresh, overwrite it
        try:
            _verified(sched)
        except ScheduleError:
            return None
        return sched

    @contextmanager
    def _turn_to_plan(self, key):
        """Yields the plan the disk cache holds for ``key``, or None: then the caller plans it.

        Ranks of one node that miss the same plan take turns through an ``flock`` on a lock file of
        that plan in the node's temporary folder (node-local, so a cache folder shared over NFS is
        not polled by every rank of a job): the first plans under an exclusive lock; the others wait
        for a shared one, get it together once the plan is stored, and load it. One plan's work
        instead of one per rank, on cores they share. Where no lock can be had (no disk cache, no
        usable temporary folder, a holder not done within :data:`PLAN_WAIT_SECONDS`), a process
        plans alone."""
        held = self._load(key)
        fd = lock = None
        if held is None and self.cache_dir is not None:
            try:
                import fcntl

                path = _lock_path(self._path(key))
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                if _flock(fd, fcntl.LOCK_EX):
                    lock = path
                elif _flock(fd, fcntl.LOCK_SH, PLAN_WAIT_SECONDS):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                held = self._load(key)           # stored by another process meanwhile
            except (ImportError, OSError):
                pass
        try:
            yield held
        finally:
            if lock is not None:    # the plan is stored (or failed): a process that comes later finds
                lock.unlink(missing_ok=True)     # it, or makes the lock anew; those waiting hold this one
            if fd is not None:
                os.close(fd)                     # (which releases the lock)

    def _store(self, key, sched):
        """Store ``sched`` as the plan of its size class, unless another process stored a valid one
        first: that one stays and is returned, so that every process runs the same plan (two sizes
        of one class may choose differently). Returns the schedule the class holds."""
        if self.cache_dir is None:
            return sched
        path = self._path(key)
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            if not write_file(path, sched.to_json(), replace=False):
                held = self._load(key)
                if held is not None:
                    return held
                write_file(path, sched.to_json())      # what was there is not a valid plan of this call
        except OSError as exc:
            # a read-only home must not stop training; the memory cache still works
            self.cache_problem = f"{path}: cannot store the plan ({exc.strerror or exc})"
        return sched


def _lock_path(path):
    """The node-local lock file of the plan file ``path`` (see :meth:`Planner._turn_to_plan`), in a
    folder of this user's own."""
    folder = Path(tempfile.gettempdir()) / f"ddl-plan-locks-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid():     # made by someone else, who could hold our locks
        raise PermissionError(f"{folder} belongs to another user")
    return folder / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".lock")


def _flock(fd, operation, wait=0.0):
    """Take ``flock``'s ``operation`` on ``fd``, trying for up to ``wait`` seconds; whether it did."""
    import fcntl

    deadline, pause = time.monotonic() + wait, 0.001
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.02)


def _pin_key(collective, root):
    """A call's collective, and its root for broadcast only (the other collectives have none, so any
    root asks for the same plan). A pinned schedule serves every size and algorithm of its key."""
    return collective, root if collective == "broadcast" else 0


def _key(collective, nbytes, algorithm, root):
    """The caches' key of a call: :func:`_pin_key`, the algorithm and the size class."""
    return (*_pin_key(collective, root), algorithm, size_class(nbytes))


_FORKED = None     # what forked workers inherit (see _forked_workers)


def _can_fork(workers, jobs):
    """Whether ``jobs`` independent jobs go to forked workers: more than one of each, where processes
    can be forked."""
    return workers > 1 and jobs > 1 and "fork" in multiprocessing.get_all_start_methods()


@contextmanager
def _forked_workers(workers, jobs, shared):
    """A pool of up to ``workers`` forked processes for ``jobs`` jobs, which inherit ``shared`` as
    :data:`_FORKED` (the candidates to build, or to simulate and prove); shut down on leaving, jobs
    not yet started cancelled."""
    global _FORKED
    _FORKED = shared
    pool = ProcessPoolExecutor(min(workers, jobs), mp_context=multiprocessing.get_context("fork"))
    try:
        yield pool
    except BaseException as exc:
        pool.shutdown(wait=False, cancel_futures=True)    # an error or an interrupt: no waiting for jobs
        if isinstance(exc, BrokenProcessPool):
            raise PlanError(f"a planner worker process died (the system may have ended it for want of memory: "
                            f"{workers} workers each hold a copy of the plan's candidates); plan with fewer "
                            f"workers (Planner(..., workers=1), ddl plan --workers 1)") from None
        raise
    else:
        # every job has ended (the callers wait for all): waiting costs nothing, and an interpreter that
        # exits while the pool's manager thread still closes its pipes prints "Bad file descriptor"
        pool.shutdown(wait=True)
    finally:
        _FORKED = None


def _build_forked(name):
    """A candidate built in a forked worker and, in a race, simulated there (see :meth:`Planner._build_all`)."""
    planner, collective, nbytes, root, fastest, slack = _FORKED
    if fastest is None:
        return planner._built(name, collective, nbytes, root)

    def ceiling():
        return fastest.value * slack
    sched = planner._built(name, collective, nbytes, root, ceiling)
    if isinstance(sched, Schedule):
        try:
            result = _simulated(planner.topo, sched, nbytes, ceiling)     # (a stopped run's bound stays on it)
        except ScheduleError:
            return sched                        # raised where the planner simulates it, as before
        if not isinstance(result, Outpaced):
            with fastest.get_lock():
                fastest.value = min(fastest.value, result.seconds)
    return sched


def _fewest_messages(candidates, fastest, margin):
    """The fastest candidate, or with a ``margin`` the one of fewest messages among those predicted
    within it of the fastest (ties: faster, then registered first)."""
    if not margin:
        return fastest
    limit = candidates[fastest][1].seconds * (1.0 + margin)
    near = [name for name, (_, sim) in candidates.items() if sim.seconds <= limit]
    return min(near, key=lambda name: (candidates[name][1].transfers, candidates[name][1].seconds))


def _predict(topo, schedules, nbytes, workers, prune=False, slack=1.0, fastest=math.inf):
    """``({name: Simulation}, {name: at least seconds}, {name: True or the ScheduleError})`` for
    ``schedules`` (name -> Schedule): the simulations run to their end, those stopped because they
    could not win (only with ``prune``: predicted over ``slack`` times the fastest, of these or
    ``fastest``, a time already simulated), and the proofs already made.

    Simulated here, none is proved (the planner then proves only the schedule it picks). Simulated in
    ``workers`` forked processes, when that pays, the largest first so that the workers end together;
    the fastest time so far sits in shared memory, where running simulations read it as their
    ceiling. The winner is proved by the time the last simulation ends, wherever a core is free:

    * a worker whose simulation ends at least as fast as every one before it publishes its time there
      and proves that schedule at once, in the same process, where the dataflow the simulation
      replayed is already built;
    * a worker with no simulation left to start proves the largest schedule still being simulated,
      beside its simulation (at 1024 ranks the ring, whose simulation and proof are each tens of
      seconds, would otherwise be proved after it).

    A proof is abandoned as soon as its schedule can no longer win (outpaced, or overtaken), and is
    made once: a worker leaves it to one that has started it.

    In one process the quickest simulations come first: those already run (an algorithm that chose
    among variants of its own by simulating them) and then the smallest schedules. The fastest of
    them is the ceiling the large ones must beat, so a large one that cannot is stopped at its first
    checks instead of being simulated to its end (the 1024-rank ring's 4.2 million operations, whose
    busiest link alone takes longer than hierarchical's whole run)."""
    if not _can_fork(workers, len(schedules)) or sum(s.nops for s in schedules.values()) < PARALLEL_MIN_OPS:
        sims, outpaced, best = {}, {}, fastest
        quickest_first = sorted(schedules, key=lambda n: 0 if simulated(topo, schedules[n], nbytes)
                                else schedules[n].nops)
        for name in quickest_first:
            result = _simulated(topo, schedules[name], nbytes, (lambda: best * slack) if prune else None)
            if isinstance(result, Outpaced):
                outpaced[name] = result.at_least
            else:
                sims[name] = result
                best = min(best, result.seconds)
        return sims, outpaced, {}
    largest_first = sorted(schedules, key=lambda n: -schedules[n].nops)
    with _forked_workers(workers, len(schedules), _Shared(topo, schedules, nbytes, prune, largest_first,
                                                          slack, fastest)) as pool:
        simulations = {pool.submit(_simulate_forked, name): name for name in largest_first}
        proofs = {pool.submit(_prove_forked, name): name for name in largest_first}
        sims, outpaced, proved = {}, {}, {}
        for future in as_completed([*simulations, *proofs]):
            name = simulations.get(future) or proofs[future]
            result, proof = future.result() if future in simulations else (None, future.result())
            if isinstance(result, Outpaced):
                outpaced[name] = result.at_least
            elif result is not None:
                sims[name] = result
            if proof is not None:
                proved[name] = proof
        return sims, outpaced, proved


class _Shared:
    """What the forked workers of one prediction share: the candidates, the fastest time so far and
    which candidate set it, and per candidate whether it can no longer win, whether its simulation has
    shown it may (it passed a check against that time, or ended), and whether a worker has taken its
    proof."""

    def __init__(self, topo, schedules, nbytes, prune, names, slack=1.0, fastest=math.inf):
        self.topo, self.schedules, self.nbytes, self.prune, self.slack = topo, schedules, nbytes, prune, slack
        self.index = {name: i for i, name in enumerate(names)}
        self.fastest = multiprocessing.Value("d", fastest)
        self.leader = multiprocessing.RawValue("i", -1)        # written under fastest's lock
        self.lost = multiprocessing.RawArray("b", len(names))    # single bytes: no lock needed to read
        self.contending = multiprocessing.RawArray("b", len(names))   # see _prove_forked
        self.taken = multiprocessing.Array("b", len(names))

    def take(self, i):
        """True for the one worker that takes candidate ``i``'s proof."""
        with self.taken.get_lock():
            first = not self.taken[i]
            self.taken[i] = 1
        return first

    def prove(self, name):
        """True, the ScheduleError, or None when abandoned (the candidate can no longer win)."""
        i = self.index[name]
        try:
            return _verified(self.schedules[name], stop=lambda: self.lost[i])
        except ScheduleError as exc:
            return exc
        except Abandoned:
            return None


def _simulated(topo, sched, nbytes, ceiling):
    """The Simulation of ``sched``, or the :class:`Outpaced` that stopped it."""
    try:
        return simulate(topo, sched, nbytes, ceiling)
    except Outpaced as exc:
        return exc


def _simulate_forked(name):
    """``(Simulation or Outpaced, proof or None)`` in a worker (see :func:`_predict`)."""
    shared = _FORKED
    i = shared.index[name]
    calls = 0

    def ceiling():
        nonlocal calls
        calls += 1
        if calls == 2:                  # the run passed its first check (see simulate)
            shared.contending[i] = 1
        return shared.fastest.value * shared.slack
    try:
        result = _simulated(shared.topo, shared.schedules[name], shared.nbytes, ceiling if shared.prune else None)
    except BaseException:
        shared.lost[i] = 1
        raise
    finally:
        shared.contending[i] = 1
    if isinstance(result, Outpaced):
        shared.lost[i] = 1
        return result, None
    with shared.fastest.get_lock():
        leads = result.seconds <= shared.fastest.value
        if leads:
            shared.fastest.value = result.seconds
            if shared.leader.value >= 0:
                shared.lost[shared.leader.value] = 1       # overtaken
            shared.leader.value = i
        else:
            shared.lost[i] = 1
    return result, shared.prove(name) if leads and shared.take(i) else None


def _prove_forked(name):
    """In a worker with no simulation left to start: the proof of ``name`` if it may still win and no
    other worker has taken it, else None (see :func:`_predict`).

    With pruning, it waits until the simulation has passed a check against the fastest time (or
    ended): until then nothing says the schedule may win, and a large loser is typically stopped at
    its first check, once set up (at 1024 ranks the ring was, 0.1 s after a worker had begun its
    proof, which then spent 20 s on its own set-up, the ring's dataflow and initial symbols, before
    it could be told)."""
    shared = _FORKED
    i = shared.index[name]
    while shared.prune and not (shared.contending[i] or shared.lost[i]):
        time.sleep(0.01)
    if shared.lost[i] or not shared.take(i):
        return None
    return shared.prove(name)


def _check_collective(collective):
    if collective not in COLLECTIVES:
        raise PlanError(f"unknown collective {collective!r}; choose one of: {', '.join(COLLECTIVES)}")


def _check_request(topo, collective, nbytes, root):
    """``(nbytes, root)`` of a request as the planner uses them, or one PlanError saying which argument
    is wrong: a collective it knows, a size in bytes (an integer, or text such as ``'64MiB'``) and a
    root that is a rank (checked for broadcast, the one collective that has one)."""
    _check_collective(collective)
    try:
        nbytes = message_size(nbytes)
    except (TypeError, ValueError) as exc:
        raise PlanError(str(exc)) from None
    if collective != "broadcast":
        return nbytes, 0               # no root: any value asks for the same plan
    if isinstance(root, (bool, str)) or not hasattr(root, "__index__"):
        raise PlanError(f"root must be a rank number, got {root!r}")
    root = int(root)
    if not 0 <= root < topo.nranks:
        raise PlanError(f"root {root} is not a rank of {topo.name} (ranks 0..{topo.nranks - 1})")
    return nbytes, root


def _verified(sched, stop=None):
    """A planner bug (or a hand-edited cache file) must never reach an executor: prove it first."""
    verify(sched, stop)
    return True


def _explain(chosen, requested, seconds, baselines, outpaced, bound, nbytes):
    from .units import format_seconds, format_size

    if requested != AUTO:
        head = f"{chosen} was requested"
    elif not baselines and not outpaced:
        head = f"{chosen} is the only algorithm that applies"
    else:
        head = f"{chosen} is predicted fastest at {format_size(nbytes)}: {format_seconds(seconds)}"
        if baselines and seconds <= 0:
            head += " (nothing moves: every algorithm takes no time)"
        elif baselines:
            runner, runner_s = min(baselines.items(), key=lambda kv: kv[1])
            head += (f", {_lead(runner_s / seconds)} the next best "
                     f"{'run to its end ' if outpaced else ''}({runner}, {format_seconds(runner_s)})")
        if not baselines:
            head += "; every other was stopped once it could not win"
        elif len(outpaced) == 1:
            head += "; 1 more was stopped once it could not win"
        elif outpaced:
            head += f"; {len(outpaced)} more were stopped once they could not win"
    return head + _regime(seconds, bound)


def _lead(ratio):
    """How much faster the chosen algorithm is than the next best, in words that do not claim a lead
    the printed figure cannot show (a tie printed as "1.00x faster")."""
    if ratio >= 1.005:
        return f"{ratio:.2f}x faster than"
    if ratio >= 1.0005:
        return f"{(ratio - 1) * 100:.1f}% faster than"
    return "as fast as"


def _explain_fewer(chosen, sim, fastest, fastest_sim, margin, bound):
    from .units import format_seconds

    return (f"{chosen} sends the fewest messages ({sim.transfers}) of the algorithms predicted within "
            f"{margin:.0%} of the fastest ({fastest}, {format_seconds(fastest_sim.seconds)}, {fastest_sim.transfers} "
            f"messages; {chosen} {format_seconds(sim.seconds)}): without a topology file the network is "
            f"assumed, and it charges nothing per message" + _regime(sim.seconds, bound))


def _regime(seconds, bound):
    """What kind of size this is, for the explanation (nothing when nothing moves)."""
    if seconds <= 0:
        return ""
    regime = ("latency-bound (the message is small: fewest rounds wins)"
              if bound.latency_seconds >= bound.bandwidth_seconds else
              "bandwidth-bound (the message is large: using every link's capacity wins)")
    return f"; this size is {regime}"

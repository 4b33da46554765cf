"""``ddl plan``: plan a collective on a topology file and explain the choice."""
import json
import os

from ..errors import PlanError, ScheduleError
from ..schedule import COLLECTIVES, Schedule, collective_name
from ..units import counted, format_bandwidth, format_seconds, format_size, parse_size
from . import check_output_file, same_file_as_any

TIMELINE_SLICES = 60      # --timeline: the run cut into this many equal slices
TIMELINE_LEVELS = " .:-=+*#%@"   # idle ... full, a tenth per step

# Columns of --compare: a label and the algorithms it stands for (the fastest of them). "rings" is a
# ring as NCCL runs it: one ring, or several channels where they add bandwidth.
COMPARED = (("rings", ("ring", "ring-channels")), ("halving-doubling", ("halving-doubling",)),
            ("double-binary-tree", ("double-binary-tree",)))


def register(sub):
    p = sub.add_parser("plan", help="plan a collective on a topology and explain the choice",
                       description="Plan a collective for a topology file: the algorithm chosen and why, "
                                   "predicted time, algorithm and bus bandwidth, the lower bound and the gap. "
                                   "The chosen schedule goes into the plan cache ($DDL_CACHE_DIR, default "
                                   "~/.cache/ddl; DDL_PLAN_CACHE=0: not), where the ranks of a job on the "
                                   "same topology load it instead of planning.")
    p.add_argument("files", nargs="+", metavar="FILE", help="topology file (YAML or JSON); several with --compare")
    p.add_argument("--bytes", default="256MiB", metavar="SIZE",
                   help="message size, e.g. 256MiB, 64MB, 1048576 (default 256MiB); several, comma-separated "
                        "(4MiB,64MiB), plan each in turn (not with --compare or --save): a job's bucket sizes "
                        "planned ahead at once")
    p.add_argument("--collective", default=None, choices=COLLECTIVES, type=collective_name,
                   help="default allreduce (any case; Bcast and Reduce_scatter_block too)")
    p.add_argument("--algorithm", default="auto", metavar="NAME", help="auto (default) or an algorithm name")
    p.add_argument("--root", type=int, default=0, help="root rank for broadcast")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list with --compare)")
    p.add_argument("--save", metavar="FILE.json", help="write the chosen schedule as JSON")
    p.add_argument("--schedule", metavar="FILE.json",
                   help="instead of planning, prove and predict this schedule (one written with --save, perhaps "
                        "edited by hand) on FILE at each size, against the bound; a job runs it after "
                        "comm.planner.pin(FILE.json)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="processes that build and simulate the candidates of a cold plan (default: one per core)")
    p.add_argument("--compare", action="store_true",
                   help="one table: auto against rings (ring or ring-channels, the faster), halving-doubling "
                        "and double-binary-tree per file (every candidate's simulation is run to its end)")
    p.add_argument("--timeline", action="store_true",
                   help="how busy each of the busiest links is over the run (a pipeline that fills and "
                        "drains shows as idle slices at the ends)")
    p.set_defaults(func=run)


def run(args):
    from ..planner import Planner
    from ..topology import Topology

    try:
        sizes = [parse_size(text) for text in args.bytes.split(",")]
    except ValueError as exc:
        raise PlanError(f"--bytes: {exc}") from None
    given = None
    if args.schedule is not None:
        if args.compare or args.save or args.algorithm != "auto" or len(args.files) > 1:
            raise PlanError("--schedule evaluates one given schedule on one FILE: not with --compare, --save "
                            "or --algorithm")
        given = Schedule.load(args.schedule)
        if args.collective not in (None, given.collective):
            raise PlanError(f"--collective {args.collective}: {args.schedule} holds a schedule of {given.collective}")
        if args.root and args.root != given.root:
            raise PlanError(f"--root {args.root}: {args.schedule} broadcasts from rank {given.root}")
        args.collective, args.root = given.collective, given.root
    args.collective = args.collective or "allreduce"
    if args.workers < 1:
        raise PlanError(f"--workers {args.workers}: at least 1 (the processes that simulate the candidates)")
    if len(args.files) > 1 and not args.compare:
        raise PlanError("several files need --compare")
    if len(sizes) > 1 and (args.compare or args.save):
        raise PlanError(f"--bytes {args.bytes}: {'--compare' if args.compare else '--save'} takes one size")
    if args.compare and args.algorithm != "auto":
        raise PlanError(f"--compare shows auto's choice against the baselines; drop --algorithm {args.algorithm} "
                        f"(its time is in the table when it is a baseline, and `ddl plan FILE --algorithm "
                        f"{args.algorithm}` plans it alone)")
    if args.compare and args.timeline:
        raise PlanError("--timeline goes with one plan's report, not --compare's table: drop one of them")
    if args.save is not None and len(args.files) > 1:
        raise PlanError("--save writes one schedule: plan one FILE with it")
    if args.root and args.collective != "broadcast":
        raise PlanError(f"--root {args.root}: {args.collective} has no root (--root is for --collective broadcast)")
    if args.save is not None:
        check_output_file("--save", args.save, "plan.json")
        if same_file_as_any(args.save, args.files):
            raise PlanError(f"--save {args.save} is the topology file itself: name another file for the schedule")
    topos = []
    for path in args.files:            # every file read and checked before any is planned
        topo = Topology.load(path)
        if not 0 <= args.root < topo.nranks:
            raise PlanError(f"--root {args.root} is not a rank of {path} ({counted(topo.nranks, 'rank')}: "
                            f"give 0{f' to {topo.nranks - 1}' if topo.nranks > 1 else ''})")
        topos.append(topo)
    plans = []
    for topo in topos:
        planner = Planner(topo, workers=args.workers)
        for nbytes in sizes:
            if given is not None:
                try:
                    plans.append((topo, planner.evaluate(given, nbytes, source=args.schedule), None))
                except (ScheduleError, PlanError) as exc:     # (PlanError: for another rank count, say)
                    raise type(exc)(f"{args.schedule}: {exc}") from None
                continue
            plan = planner.plan(args.collective, nbytes, args.algorithm, args.root, exhaustive=args.compare)
            plans.append((topo, plan, _cache_state(planner, args, nbytes, plan)))
    if args.save:
        try:
            plans[0][1].schedule.save(args.save)
        except OSError as exc:         # what the checks before could not foresee (/proc, a full disk)
            raise PlanError(f"--save {args.save}: cannot write it ({exc.strerror or exc})") from None
    records = [_record(topo, plan, cached, _timeline(topo, plan) if args.timeline else None)
               for topo, plan, cached in plans]
    if args.json:
        print(json.dumps(records if args.compare or len(records) > 1 else records[0], indent=2))
    else:
        print(_compare_table(records) if args.compare else
              "\n\n".join(_explain(topo, plan, r) for (topo, plan, _), r in zip(plans, records)))
        if args.save:
            print(f"schedule written to {args.save}")
    return 0


def _timeline(topo, plan):
    """``{"u->v": {"profile": [utilisation per slice], "idle_start": s, "idle_end": s, "idle_between": s}}``
    for the plan's busiest links, from simulating it again with those links traced (the simulation is
    deterministic: the same run as the prediction). The idle times say what a gap to the bound is made
    of: a pipeline filling (start), draining (end), or stages waiting on each other (between)."""
    from ..simulate import simulate

    if not plan.busiest or not plan.predicted_seconds:
        return {}
    links = [link for link, _, _ in plan.busiest]
    sim = simulate(topo, plan.schedule, plan.nbytes, trace=links)
    out = {}
    for u, v in links:
        spans = sim.timeline[(u, v)]
        start = spans[0][0] if spans else sim.seconds
        end = sim.seconds - spans[-1][1] if spans else 0.0
        busy = sum(b - a for a, b, _ in spans)
        out[f"{u}->{v}"] = {"profile": sim.profile((u, v), topo.capacity(u, v), TIMELINE_SLICES),
                            "idle_start": start, "idle_end": end,
                            "idle_between": max(0.0, sim.seconds - start - end - busy)}
    return out


def _times(ratio):
    """``1.27x``; ``1.003x`` where two decimals would print a lead the report's "why" names (0.3%) as
    ``1.00x``."""
    return f"{ratio:.3f}x" if 1.0005 <= ratio < 1.005 else f"{ratio:.2f}x"


def _strip(profile):
    """One character per slice, from idle (blank) to full (@)."""
    return "".join(map(_glyph, profile))


def _glyph(load):
    """The character of a slice busy ``load`` (0..1) of the time: the nearest level, but never blank
    unless idle, since the legend says blank is idle (rounding put a slice under 1/18 busy there)."""
    top = len(TIMELINE_LEVELS) - 1
    level = min(top, int(load * top + 0.5))
    return TIMELINE_LEVELS[max(level, 1) if load > 0 else level]


def _cache_state(planner, args, nbytes, plan):
    """What the disk cache holds for the plan's size class, as ``(file, whether it holds this plan,
    the schedule it holds, why nothing is stored, the algorithm asked for)``, or None for 0 bytes
    (nothing is stored: a job's empty call runs the 1-byte class's plan)."""
    if nbytes == 0:
        return None
    path = planner.cache_file(args.collective, nbytes, args.algorithm, args.root)
    stored = planner.stored(args.collective, nbytes, args.algorithm, args.root)
    problem = None if stored is not None else (planner.cache_problem or f"{path}: the plan was not stored")
    return path, stored is not None and stored == plan.schedule, stored, problem, args.algorithm


def _record(topo, plan, cached=None, timeline=None):
    """The plan as a JSON-ready dict; ``cached``: :func:`_cache_state` or None."""
    from ..bounds import busbw

    p = topo.nranks
    sched = plan.schedule
    extra = {} if timeline is None else {"timeline": timeline}
    return {
        "topology": topo.name,
        "collective": plan.collective,
        "algorithm": plan.algorithm,
        "ranks": p,
        "bytes": plan.nbytes,
        "root": int(sched.root) if plan.collective == "broadcast" else None,
        "predicted_seconds": plan.predicted_seconds,
        "bound_seconds": plan.bound_seconds,
        "bandwidth_bound_seconds": plan.bandwidth_bound_seconds,
        "latency_bound_seconds": plan.latency_bound_seconds,
        "message_cost_seconds": topo.message_cost,
        "gap": plan.gap,
        "below_latency_bound": _below_latency_bound(plan.gap),
        "algbw": plan.nbytes / plan.predicted_seconds if plan.predicted_seconds else None,
        "busbw": busbw(plan.collective, plan.nbytes, plan.predicted_seconds, p) if plan.predicted_seconds else None,
        "baselines": plan.baselines,
        "outpaced": plan.outpaced,
        "not_planned": plan.skipped,
        "verified": plan.verified,
        "reason": plan.reason,
        "chunks": sched.nchunks,
        "spans": len(sched.spans),
        "operations": sched.nops,
        "busiest_links": [{"link": f"{u}->{v}", "utilisation": util, "bytes": b} for (u, v), util, b in plan.busiest],
        "cache_file": str(cached[0]) if cached and cached[1] else None,
        "cache_holds_other": ({"file": str(cached[0]), "algorithm": cached[2].algorithm}
                              if cached and cached[2] is not None and not cached[1] else None),
        "cache_problem": cached[3] if cached else None,
        "cache_for_algorithm": cached[4] if cached else None,
        **extra,
    }


def _explain(topo, plan, r):
    """The text form of ``r``, the plan's :func:`_record` (with its timeline, when asked for)."""
    timeline = r.get("timeline")
    lines = [
        f"topology    {topo.name} ({counted(topo.nranks, 'rank')}"
        + (f", {counted(len(topo.hosts), 'host')})" if topo.hosts else ")"),
        f"collective  {_what(r)}",
        f"algorithm   {plan.algorithm}",
        f"why         {plan.reason}",
    ]
    if plan.predicted_seconds:
        cost = f"   ({format_seconds(topo.message_cost)} per message)" if topo.message_cost else ""
        lines.append(f"predicted   {format_seconds(plan.predicted_seconds)}   algbw {format_bandwidth(r['algbw'])}"
                     f"   busbw {format_bandwidth(r['busbw'])}{cost}")
    else:
        lines.append("predicted   0 s (nothing to move)")
    lines.append(f"bound       {format_seconds(plan.bound_seconds)} (bandwidth {format_seconds(plan.bandwidth_bound_seconds)},"
                 f" latency {format_seconds(plan.latency_bound_seconds)})   gap {plan.gap:.3f}x")
    if _below_latency_bound(plan.gap):
        lines.append("note        below the latency bound: this schedule has ranks send or receive several"
                     " messages at once, which the bound's round model rules out"
                     + ("" if topo.message_cost else " and the simulator charges nothing for (no message_cost"
                                                      " in the file's defaults)"))
    spans = f", {counted(r['spans'], 'span')}" if r["spans"] else ""
    lines.append(f"verified    {'yes' if plan.verified else 'NO'} ({counted(r['chunks'], 'chunk')}{spans}, "
                 f"{counted(r['operations'], 'operation')})")
    if r["cache_file"] or r["cache_holds_other"]:
        from ..planner import size_class
        top = size_class(plan.nbytes)
        sizes = f"more than {format_size(top // 2)}, up to {format_size(top)}" if top > 1 else "1 B"
        asked = r["cache_for_algorithm"]
        who = "a job's ranks" if asked in (None, "auto") else f"a job's ranks that ask for algorithm={asked!r}"
        if r["cache_file"]:
            lines.append(f"cached      {r['cache_file']}\n            ({who} on this topology load it instead "
                         f"of planning: the plan of every {plan.collective} of its size class, {sizes})")
        else:
            other = r["cache_holds_other"]
            lines.append(f"not cached  {other['file']}\n            holds a plan made before for this size class "
                         f"({sizes}; {other['algorithm']}), which {who} run; delete it to store this one")
    elif r["cache_problem"]:
        lines.append(f"not cached  {r['cache_problem']}\n            (a job's ranks plan this size class themselves)")
    for name, secs in sorted(plan.baselines.items(), key=lambda kv: kv[1]):
        ratio = f"{_times(secs / plan.predicted_seconds)} the chosen time" if plan.predicted_seconds else "nothing to move"
        lines.append(f"  vs {name:<22} {format_seconds(secs):>10}   ({ratio})")
    for name, secs in sorted(plan.outpaced.items(), key=lambda kv: kv[1]):
        ratio = secs / plan.predicted_seconds if plan.predicted_seconds else float("nan")
        lines.append(f"  vs {name:<22} >{format_seconds(secs):>9}   (>{_times(ratio)}: stopped once it could not win)")
    for name, why in plan.skipped.items():
        lines.append(f"  not planned: {name} ({why})")
    if plan.busiest:
        lines.append("busiest links" + (f" (over the run, {TIMELINE_SLICES} slices: blank idle, @ full)"
                                         if timeline else ""))
        for (u, v), util, nbytes in plan.busiest:
            lines.append(f"  {u} -> {v}: {util:6.1%} busy, {format_size(int(nbytes))}")
            if timeline:
                t = timeline[f"{u}->{v}"]
                lines.append(f"    |{_strip(t['profile'])}| idle: {format_seconds(t['idle_start'])} first, "
                             f"{format_seconds(t['idle_end'])} last, {format_seconds(t['idle_between'])} between")
    return "\n".join(lines)


def _compare_table(records):
    head = f"{'topology':<28}{'ranks':>6}  {'auto picks':<20}{'busbw':>12}{'gap':>7} " + "".join(
        f"{'vs ' + label:>24}" for label, _ in COMPARED)
    rows = [_what(records[0]), head, "-" * len(head)]
    for r in records:
        cells = []
        for _, names in COMPARED:
            times = [r["predicted_seconds"] if n == r["algorithm"] else r["baselines"].get(n) for n in names]
            secs = min((t for t in times if t is not None), default=None)
            cells.append(f"{secs / r['predicted_seconds']:>23.2f}x" if secs and r["predicted_seconds"] else f"{'n/a':>24}")
        busbw = format_bandwidth(r["busbw"]) if r["busbw"] else "-"
        below = "*" if _below_latency_bound(r["gap"]) else " "
        rows.append(f"{r['topology']:<28}{r['ranks']:>6}  {r['algorithm']:<20}{busbw:>12}{r['gap']:>6.3f}x{below}"
                    + "".join(cells))
    if any(_below_latency_bound(r["gap"]) for r in records):
        rows.append("* below the latency bound: ranks send or receive several messages at once, which the "
                    "bound's round model rules out")
    return "\n".join(rows)


def _what(r):
    """``allreduce of 256 MiB``, ``broadcast of 1 MiB from rank 2``: the call a record plans."""
    root = f" from rank {r['root']}" if r["root"] is not None else ""
    return f"{r['collective']} of {format_size(r['bytes'])}{root}"


def _below_latency_bound(gap):
    return gap < 1 - 1e-9

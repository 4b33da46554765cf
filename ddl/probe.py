"""Measure a running job's fabric against its topology file (``ddl topo probe``).

Why
===
Every plan is only as good as the file it was made from. A NIC that came up at 25 Gbit/s instead of 100,
a rack uplink that another job shares, a file written from the vendor's sheet rather than the machine,
ranks that the launcher placed otherwise than the file's ``ranks`` list: each one leaves ddl planning
for a cluster that is not there, and nothing says so. Blink probes its links at run time for the same
reason. The probe measures what the fabric carries between the job's own ranks and says, per class of
route, whether the file's figure holds.

What it measures
================
* **Placement**: ranks the file puts on one host must run on one machine (MPI's processor name), and
  ranks on different hosts on different machines.
* **Bandwidth per route class** (:func:`pair_classes`): rank pairs whose routes have the same
  bottleneck bandwidth, latency and hop count, on one host or between hosts, form a class. One pair
  per class (``per_class`` more, on hosts not yet covered) sends one message sized to take
  :data:`TARGET_SECONDS` at the file's rate, timed until the receiver's one-byte reply is back; the
  best of ``repeats`` counts. The class passes when it is within ``tolerance`` of the file's rate;
  faster fails too (the plan then balances its links by the wrong weights). A failing class names
  the links that bound its route in the file: the ones to check.
* **All at once** (:func:`host_patterns`): every host's first rank sends to the host 1, then H/2,
  further in host order, all at the same time, so that the links above the hosts carry what their
  hosts send through them together (a rack's uplink, which a pair alone may never fill). The time
  until the last flow is in is judged against the file's: each flow at its busiest link's capacity
  shared by the flows on it.
* **Latency** of the pairs alone: half the median round trip of 8-byte messages, beside the sum of the
  file's link latencies along the route. Reported, not judged: it includes MPI's software time.
* **Reduction rate**: ``numpy.add`` of two float32 arrays as the executor runs it (bytes of one operand
  per second), on every rank at once as in a collective (a host's ranks share its memory and cores),
  the median of each host's ranks against the file's ``reduce_bandwidth``; judged like a link.

Transfers go between host buffers with MPI, one pair at a time while every other rank sleeps, so that
what is measured is the pair's route alone. GPU ranks: pairs within a host are not measured (host
memory does not take their NVLink or PCIe peer links); pairs between hosts are, from host memory.
"""
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .agreement import format_ranks
from .units import counted, format_bandwidth, format_seconds, format_size

TARGET_SECONDS = 0.25
MIN_BYTES, MAX_BYTES = 1 << 20, 256 << 20
TOLERANCE = 0.15
REPEATS = 2
PINGS = 30
REDUCE_BYTES = 64 << 20
REDUCE_ROUNDS = 9
GPU_PAIR_SKIP = "GPUs on one host: host memory does not take their links (NVLink, PCIe peer copies)"


@dataclass
class PairClass:
    """Rank pairs whose routes the file describes alike; ``pairs`` are the ones to measure."""
    same_host: bool
    rate: float             # the file's route bandwidth (bytes/s; inf for two ranks on one vertex)
    latency: float          # the file's route latency (s)
    hops: int
    size: int               # how many rank pairs (of those considered) fall in the class
    pairs: list
    skip: str = None        # why the class is not measured

    @property
    def label(self):
        return "same host" if self.same_host else "between hosts"


@dataclass
class Finding:
    """One measured item against the file: a pair of a class, a pattern of flows at once, or a host's
    reduction rate."""
    what: str               # "bandwidth" (a pair alone), "pattern" (flows at once) or "reduce"
    label: str
    where: str
    expected: float         # bytes/s, or None when the file sets no finite figure
    measured: float
    tolerance: float
    latency: float = None
    expected_latency: float = None
    nbytes: int = 0
    bottleneck: list = field(default_factory=list)
    pair: tuple = None      # (i, j) of a pair's finding

    @property
    def ratio(self):
        return None if not self.expected else self.measured / self.expected

    @property
    def ok(self):
        return self.ratio is None or abs(self.ratio - 1) <= self.tolerance

    @property
    def verdict(self):
        if self.ok:
            return "ok" if self.ratio is not None else "not judged"
        return "SLOWER than the file" if self.ratio < 1 else "FASTER than the file"

    def fix(self):
        """What to check, in one sentence, for a failed finding."""
        got = format_bandwidth(self.measured)
        if self.what == "reduce":
            return (f"{self.where}: reductions run at {got}, the file says {format_bandwidth(self.expected)}: "
                    f"set reduce_bandwidth of its ranks (or defaults.reduce_bandwidth) to about {got}")
        one = len(self.bottleneck) == 1
        if self.what == "pattern":
            links = ", ".join(f"{u} -> {v} ({format_bandwidth(c)}, {n:g} flow{'' if n == 1 else 's'})"
                              for u, v, c, n in self.bottleneck)
            return (f"{self.label} {self.where}: each flow measured {got}; in the file the busiest "
                    f"link{'' if one else 's'} {'is' if one else 'are'} {links}: where pairs alone measure as "
                    f"the file says, a link that these flows share carries less than the file says "
                    f"(an oversubscribed uplink, a switch that is not non-blocking)")
        links = ", ".join(f"{u} -> {v} ({format_bandwidth(c)})" for u, v, c in self.bottleneck)
        return (f"{self.label} {self.where}: measured {got}; in the file the route is bounded by {links}: if "
                f"{'that link carries' if one else 'those links carry'} {got}, set {'its' if one else 'their'} "
                f"bandwidth so; if not, something else on the route holds it back (another job's traffic, "
                f"a NIC's negotiated speed, an MPI transport that is not the fast one)")

    def as_dict(self):
        return {"what": self.what, "class": self.label, "where": self.where, "expected": self.expected,
                "measured": self.measured, "ratio": self.ratio, "ok": self.ok, "bytes": self.nbytes,
                "latency": self.latency, "expected_latency": self.expected_latency,
                "bottleneck": [list(b) for b in self.bottleneck]}


# ---- what to measure (pure: no MPI) -------------------------------------------------------------------
def _leaders(topo):
    """The first rank of every host, then every rank without a host."""
    first = [ranks[0] for ranks in topo.hosts.values()]
    return sorted(first) + [i for i in range(topo.nranks) if topo.host_of(i) is None]


def pair_classes(topo, per_class=1):
    """The route classes of ``topo``'s rank pairs, each with up to ``per_class`` pairs to measure.

    Pairs considered: from and to every host's first rank (and every rank without a host), both ways,
    which meets every host and every direction of its links. The pairs of a class are picked so that
    each touches a host no earlier pick did, where one does."""
    groups = {}
    for a in _leaders(topo):
        for b in range(topo.nranks):
            if a == b:
                continue
            for i, j in ((a, b), (b, a)):
                same = topo.host_of(i) is not None and topo.host_of(i) == topo.host_of(j)
                path = topo.routes(i, j)[0]
                key = (same, topo.route_bandwidth(i, j), round(topo.route_latency(i, j), 12), len(path) - 1)
                groups.setdefault(key, {})[(i, j)] = None        # (a dict: an ordered set)
    classes = []
    for (same, rate, latency, hops), members in groups.items():
        pairs = _spread(topo, list(members), per_class)
        i, j = pairs[0]
        gpu = any(topo.kind(topo.ranks[r]) == "gpu" for r in (i, j))
        classes.append(PairClass(same, rate, latency, hops, len(members), pairs,
                                 GPU_PAIR_SKIP if same and gpu else None))
    classes.sort(key=lambda c: (not c.same_host, -c.rate, c.latency, c.hops))
    return classes


def route_bottleneck(topo, i, j):
    """``[(u, v, bytes/s)]``: the links of the route from rank ``i`` to ``j`` that bound its bandwidth
    in the file (of its first path, where several tie)."""
    path, rate = topo.routes(i, j)[0], topo.route_bandwidth(i, j)
    return [(u, v, topo.capacity(u, v)) for u, v in zip(path, path[1:]) if topo.capacity(u, v) <= rate]


def route_links(topo, i, j):
    """``[(u, v, share)]``: every link of the routes from rank ``i`` to ``j``, with the part of the pair's
    data it carries (routes that tie split it evenly, as the simulator and executors do)."""
    routes = topo.routes(i, j)
    return [(u, v, 1 / len(routes)) for path in routes for u, v in zip(path, path[1:])]


def _spread(topo, pairs, limit):
    """Up to ``limit`` of ``pairs``: first the first pair, then ones touching hosts not yet covered."""
    chosen, covered = [], set()
    for want_new in (True, False):
        for pair in pairs:
            if len(chosen) >= limit:
                return chosen
            hosts = {topo.host_of(r) if topo.host_of(r) is not None else ("rank", r) for r in pair}
            if pair in chosen or (want_new and chosen and hosts <= covered):
                continue
            chosen.append(pair)
            covered |= hosts
    return chosen


@dataclass
class Pattern:
    """Host leaders all sending at once, each to the host ``shift`` further in host order: loads the
    links that single pairs never fill (a rack's uplink shared by its hosts)."""
    shift: int
    flows: list             # [(i, j)]: rank i sends to rank j, all at once
    rate: float             # bytes/s of each flow by the file: the busiest link's capacity / its flows
    busiest: list           # [(u, v, capacity, flows on it)]: the links that set it

    label = "all at once"


def host_patterns(topo):
    """:class:`Pattern` for shifts 1 and H/2 among the H host leaders (one when they coincide, none
    below two hosts). In host order, shift 1 mostly stays near, H/2 mostly crosses the top of the
    fabric: both directions of every host's links carry one flow, the links above them as many as
    their hosts send through them."""
    leaders = _leaders(topo)
    h = len(leaders)
    out = []
    for shift in sorted({1, h // 2}) if h >= 2 else ():
        flows = [(leaders[k], leaders[(k + shift) % h]) for k in range(h)]
        load = {}
        for i, j in flows:
            for u, v, share in route_links(topo, i, j):
                load[(u, v)] = load.get((u, v), 0.0) + share
        share = {e: topo.capacity(*e) / n for e, n in load.items()}      # each flow's part of the link
        rate = min(share.values())
        busiest = [(u, v, topo.capacity(u, v), load[(u, v)]) for (u, v), r in share.items() if r <= rate * (1 + 1e-9)]
        out.append(Pattern(shift, flows, rate, busiest))
    return out


def transfer_bytes(rate):
    """Bytes of one timed transfer: :data:`TARGET_SECONDS` at ``rate``, within [1 MiB, 256 MiB]."""
    if not math.isfinite(rate):
        return MAX_BYTES
    return int(min(MAX_BYTES, max(MIN_BYTES, rate * TARGET_SECONDS))) // 4096 * 4096


def reduce_groups(topo):
    """``[(label, ranks)]`` whose reduction rate is reported: each host's ranks (their median), then
    each rank without a host; GPU ranks are not measured."""
    groups = [(f"host {h}", ranks) for h, ranks in topo.hosts.items()]
    groups += [(f"rank {r}", (r,)) for r in range(topo.nranks) if topo.host_of(r) is None]
    return [(label, ranks) for label, ranks in groups if topo.kind(topo.ranks[ranks[0]]) != "gpu"]


def placement_problems(topo, machines):
    """Sentences for every way the ranks' machines (``machines[r]``: rank r's processor name)
    contradict the file's hosts; empty when they agree."""
    problems = []
    for host, ranks in topo.hosts.items():
        names = sorted({machines[r] for r in ranks})
        if len(names) > 1:
            where = "; ".join(f"{_ranks_text([r for r in ranks if machines[r] == n])} on {n}" for n in names)
            problems.append(f"the file puts ranks {_ranks_text(ranks)} on host {host}, but they run on "
                            f"{len(names)} machines ({where})")
    by_machine = {}
    for host, ranks in topo.hosts.items():
        for name in {machines[r] for r in ranks}:
            by_machine.setdefault(name, []).append(host)
    for name, hosts in sorted(by_machine.items()):
        if len(hosts) > 1:
            problems.append(f"machine {name} runs ranks of {len(hosts)} hosts of the file "
                            f"({', '.join(sorted(hosts))}): the launcher placed the ranks otherwise than "
                            f"the file's ranks list (give mpiexec a host list in that order), or the file "
                            f"splits one machine")
    return problems


def _ranks_text(ranks):
    """``ranks 0-2, 5`` without its first word: ``0-2, 5``."""
    return format_ranks(ranks).split(" ", 1)[1]


# ---- the measurements (every rank of the job runs measure) ---------------------------------------------
def _nap_wait(req, nap=2e-4):
    """Complete a request without spinning: the ranks not under test leave the CPU to those that are."""
    while not req.Test():
        time.sleep(nap)


def _bandwidth(comm, src, dst, nbytes, repeats):
    """Best rate of ``repeats`` transfers of ``nbytes`` from src to dst (on src; None elsewhere)."""
    buf = np.ones(nbytes, np.uint8)
    ack = np.zeros(1, np.uint8)
    best = None
    for n in [min(nbytes, 1 << 16)] + [nbytes] * repeats:       # the first: connect, warm up
        if comm.rank == src:
            t0 = time.perf_counter()
            comm.Send(buf[:n], dst, tag=11)
            comm.Recv(ack, dst, tag=12)
            t = time.perf_counter() - t0
            if n == nbytes and (best is None or t < best):
                best = t
        else:
            comm.Recv(buf[:n], src, tag=11)
            comm.Send(ack, src, tag=12)
    return nbytes / best if comm.rank == src else None


def _latency(comm, src, dst):
    """Half the median round trip of 8-byte messages (on src; None elsewhere)."""
    msg = np.zeros(1, np.float64)
    times = []
    for k in range(PINGS + 5):
        if comm.rank == src:
            t0 = time.perf_counter()
            comm.Send(msg, dst, tag=13)
            comm.Recv(msg, dst, tag=14)
            if k >= 5:
                times.append(time.perf_counter() - t0)
        else:
            comm.Recv(msg, src, tag=13)
            comm.Send(msg, src, tag=14)
    return float(np.median(times)) / 2 if comm.rank == src else None


def _pattern_seconds(comm, flows, nbytes, repeats):
    """Best of ``repeats`` times, from a common start, until the last receive of ``flows`` (all sent at
    once) completes: on rank 0; None elsewhere. The ranks of the flows wait in MPI (which moves large
    messages only while it is driven), the others nap."""
    from mpi4py import MPI
    source = {j: i for i, j in flows}
    dest = {i: j for i, j in flows}
    send = np.ones(nbytes, np.uint8) if comm.rank in dest else None    # (only where a flow starts or ends,
    recv = np.ones(nbytes, np.uint8) if comm.rank in source else None  # touched: up to 256 MiB each)
    best = None
    for k in range(repeats + 1):                               # the first: connect, warm up, not counted
        _nap_wait(comm.Ibarrier())
        t0 = time.perf_counter()
        reqs = ([comm.Irecv(recv, source[comm.rank], tag=21)] if comm.rank in source else []) + \
               ([comm.Isend(send, dest[comm.rank], tag=21)] if comm.rank in dest else [])
        elapsed = 0.0
        if reqs:                        # MPI's own wait: a large message moves only while it is driven
            reqs[0].Wait()
            elapsed = time.perf_counter() - t0 if comm.rank in source else 0.0
            MPI.Request.Waitall(reqs[1:])
        took = comm.reduce(elapsed, op=MPI.MAX, root=0)
        if k and comm.rank == 0:
            best = took if best is None else min(best, took)
    return best


def _reduce_rates(comm, repeats):
    """Bytes of one float32 operand that ``numpy.add(a, b, out=a)`` combines per second on this rank,
    with every rank of the job reducing at the same time (as in a collective, where a host's ranks
    share its memory and cores): the median of ``repeats`` rounds (at least :data:`REDUCE_ROUNDS`), each
    started together."""
    n = REDUCE_BYTES // 4
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    np.add(a, b, out=a)                                         # touch the pages
    times = []
    for _ in range(max(REDUCE_ROUNDS, repeats)):
        _nap_wait(comm.Ibarrier())
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - t0)
    return REDUCE_BYTES / float(np.median(times))


def measure(comm, topo, classes, patterns=(), repeats=REPEATS):
    """Run every measurement; on rank 0 return ``(machines, pair results, pattern results, reduce
    results)``.

    Pair results: ``{(i, j): (rate, latency)}``; pattern results: ``[seconds]`` in the order of
    ``patterns``; reduce results: ``{rank: rate}``. Every rank must call it with the same arguments."""
    from mpi4py import MPI
    machines = comm.allgather(MPI.Get_processor_name())
    tests = [(i, j, transfer_bytes(c.rate)) for c in classes if c.skip is None for i, j in c.pairs]
    pairs, reduces = {}, {}
    for i, j, nbytes in tests:
        _nap_wait(comm.Ibarrier())
        if comm.rank in (i, j):
            rate = _bandwidth(comm, i, j, nbytes, repeats)
            lat = _latency(comm, i, j)
            if comm.rank == i:
                pairs[(i, j)] = (rate, lat)
    timed = [_pattern_seconds(comm, pat.flows, transfer_bytes(pat.rate), repeats) for pat in patterns]
    rate = _reduce_rates(comm, repeats)
    if topo.kind(topo.ranks[comm.rank]) != "gpu":
        reduces[comm.rank] = rate
    _nap_wait(comm.Ibarrier())
    gathered = comm.gather((pairs, reduces), root=0)
    if comm.rank != 0:
        return None
    for p, r in gathered:
        pairs.update(p)
        reduces.update(r)
    return machines, pairs, timed, reduces


# ---- the report ------------------------------------------------------------------------------------------
def findings(topo, classes, pairs, reduces, tolerance=TOLERANCE, patterns=(), timed=()):
    """:class:`Finding` per measured pair (in class order), per pattern of flows at once and per host's
    reduction rate."""
    out = []
    for c in classes:
        if c.skip is not None:
            continue
        for i, j in c.pairs:
            rate, lat = pairs[(i, j)]
            out.append(Finding("bandwidth", c.label, f"{i} -> {j} ({topo.ranks[i]} -> {topo.ranks[j]})",
                               c.rate if math.isfinite(c.rate) else None, rate, tolerance, lat, c.latency,
                               transfer_bytes(c.rate), route_bottleneck(topo, i, j), (i, j)))
    for pat, seconds in zip(patterns, timed):
        nbytes = transfer_bytes(pat.rate)
        shown = ", ".join(f"{i} -> {j}" for i, j in pat.flows[:3]) + (", ..." if len(pat.flows) > 3 else "")
        out.append(Finding("pattern", pat.label, f"{len(pat.flows)} hosts to +{pat.shift}: {shown}", pat.rate,
                           nbytes / seconds, tolerance, nbytes=nbytes, bottleneck=pat.busiest))
    for label, ranks in reduce_groups(topo):
        rate = float(np.median([reduces[r] for r in ranks]))
        where = label if len(ranks) == 1 else f"{label} ({format_ranks(ranks)})"
        out.append(Finding("reduce", "reduce", where, topo.reduce_bandwidth(ranks[0]), rate, tolerance))
    return out


def report(topo, classes, found, problems, out, as_json=False):
    """Print the table (or JSON); the return value: True when everything held."""
    ok = not problems and all(f.ok for f in found)
    if as_json:
        doc = {"file": topo.source, "ranks": topo.nranks, "ok": ok, "placement": problems,
               "findings": [f.as_dict() for f in found],
               "skipped": [{"class": c.label, "pairs": c.size, "why": c.skip} for c in classes if c.skip]}
        print(json.dumps(doc, indent=1), file=out)
        return ok
    tolerance = found[0].tolerance if found else TOLERANCE
    print(f"# ddl topo probe: {topo.source or topo.name}, {counted(topo.nranks, 'rank')}; host buffers, MPI point-to-point: "
          f"pairs one at a time, then every host at once; best of the transfers; tolerance +-{tolerance:.0%}",
          file=out)
    print(f"# placement: {'as the file says' if not problems else 'DIFFERS from the file'}", file=out)
    for p in problems:
        print(f"#   {p}", file=out)
    print(f"# {'class':14s} {'pair':44s} {'bytes':>9s} {'file':>11s} {'measured':>11s} {'ratio':>6s}  "
          f"{'latency: file':>13s} {'measured':>9s}  verdict", file=out)
    for f in found:
        ratio = "-" if f.ratio is None else f"{f.ratio:.2f}"
        expected = "-" if f.expected is None else format_bandwidth(f.expected)
        lat = ("" if f.latency is None else
               f"{format_seconds(f.expected_latency) if f.expected_latency else '0':>13s} {format_seconds(f.latency):>9s}")
        size = format_size(f.nbytes) if f.nbytes else "-"
        print(f"  {f.label:14s} {f.where:44s} {size:>9s} {expected:>11s} {format_bandwidth(f.measured):>11s} "
              f"{ratio:>6s}  {lat:23s}  {f.verdict}", file=out)
    for c in classes:
        if c.skip:
            print(f"# not measured: {c.size} pairs {c.label} ({c.skip})", file=out)
    bad = [f for f in found if not f.ok]
    for f in bad:
        print(f"# fix: {f.fix()}", file=out)
    print(f"# {'all as the file says' if ok else 'the file does not describe this fabric: see above'}", file=out)
    return ok

"""Turn what ``ddl topo probe`` measured into a corrected topology file (``ddl topo probe --write``).

Why
===
The probe says where a file is wrong; the planner needs the right figures. Copying each measured rate
into the file by hand is error-prone: a route's rate belongs to the links that bound it, a rate of
flows at once to the link they share, divided among its parallel links. This module does it from the
probe's findings, so that ``ddl topo probe FILE --write FIXED`` and then ``ddl topo probe FIXED`` pass.

What changes
============
Only what was judged and failed (within the tolerance the file's figure stays):

* a pair of ranks measured at ``r`` against the file's route bandwidth ``R``: the links that bound
  that route in the file (:attr:`ddl.probe.Finding.bottleneck`) are scaled to carry ``r`` -- all but
  those that another pair crossed faster (a link carries at least what any measured route through
  it moved): where a file gives a host's NIC and its rack's uplink the same guessed figure, the pair
  within the rack measures the NIC, and the pair across racks blames the uplink alone;
* flows all at once, each at ``r``: the busiest links they share are scaled to carry ``r`` times
  their flows -- but only when every pair alone measured as the file says, since a pair that is slow
  on its own also slows the flows, and that is not the shared link's doing (probe the written file
  again, and the next pass takes the shared links); and not the links that a measurement which held
  vindicates (they bound a pair's route, or are the busiest of flows at once that ran at the file's
  rate): with a rack's uplink and its hosts' NICs equally loaded, the NICs that carried the flows
  within the rack at full rate are not what held the flows across it back;
* a host's reductions measured at ``r``: its ranks' ``reduce_bandwidth`` becomes ``r``.

A link that the file gives one bandwidth for both directions takes the lower of the two directions'
figures; parallel links between the same two vertices are scaled alike. Latencies are not changed:
the probe's include MPI's software time. The result is the file's explicit form
(:meth:`ddl.topology.Topology.to_dict`: loops written out), with a description saying what was
measured; measured figures are written to four significant digits.
"""
import math

from .probe import reduce_groups, route_links
from .units import format_bandwidth


def calibrated(topo, found):
    """``(data, changes, notes)``: ``topo``'s explicit form with the failed findings' figures written
    in (see the module docstring), one line of text per change, and one per failed finding left for
    a second pass."""
    data = topo.to_dict()
    pairs = [f for f in found if f.what == "bandwidth" and f.expected is not None]
    patterns = [f for f in found if f.what == "pattern" and f.expected is not None]
    factor, why = {}, {}                   # directed edge -> scale, and the finding that set it

    def scale(u, v, by, finding):
        if by < factor.get((u, v), math.inf):
            factor[(u, v)], why[(u, v)] = by, finding

    link_of = {}                           # directed edge -> the file link it is (both ways for undirected)
    for link in topo.links:
        link_of.setdefault((link.a, link.b), (link.a, link.b))
        if not link.directed:
            link_of.setdefault((link.b, link.a), (link.a, link.b))

    def file_link(u, v):
        return link_of.get((u, v), (u, v))

    carried = {}                           # file link -> the most a measured pair moved through it
    for f in pairs:
        for u, v, share in route_links(topo, *f.pair):
            key = file_link(u, v)
            carried[key] = max(carried.get(key, 0.0), f.measured * share)
    notes = []
    for f in pairs:
        if f.ok:
            continue
        blamed = [(u, v, c) for u, v, c in f.bottleneck if carried[file_link(u, v)] <= f.measured * (1 + f.tolerance)]
        if not blamed:
            notes.append(f"not taken: {f.label} {f.where} (every link that bounds its route carried more for "
                         f"another pair)")
        for u, v, capacity in blamed:
            scale(u, v, carried[file_link(u, v)] / capacity, f)
    pairs_hold = all(f.ok for f in pairs)
    held = {file_link(u, v) for f in pairs + patterns if f.ok for u, v, *_ in f.bottleneck}
    for f in patterns:
        if f.ok:
            continue
        if not pairs_hold:
            notes.append(f"not taken: {f.label} {f.where} (pairs alone differ from the file too: probe the "
                         f"written file again to take the links these flows share)")
            continue
        suspects = [b for b in f.bottleneck if file_link(b[0], b[1]) not in held]
        if not suspects:
            notes.append(f"not taken: {f.label} {f.where} (every link it loads most carried the file's rate "
                         f"in another measurement)")
        for u, v, capacity, flows in suspects:
            scale(u, v, f.measured * flows / capacity, f)

    changes = []
    for link, entry in zip(topo.links, data["links"]):
        directions = [(link.a, link.b)] + ([] if link.directed else [(link.b, link.a)])
        hit = [d for d in directions if d in factor]
        if not hit:
            continue
        d = min(hit, key=lambda e: factor[e])
        entry["bandwidth"] = format_bandwidth(link.bandwidth * factor[d])
        f = why[d]
        changes.append(f"link {link.a} {'->' if link.directed else '-'} {link.b}: "
                       f"{format_bandwidth(link.bandwidth)} -> {entry['bandwidth']} "
                       f"({f.label} {f.where}: {format_bandwidth(f.measured)}"
                       f"{' per flow' if f.what == 'pattern' else ''})")

    reductions = [f for f in found if f.what == "reduce"]
    nodes = {entry["id"]: entry for entry in data["nodes"]}
    for (label, ranks), f in zip(reduce_groups(topo), reductions):
        if f.ok:
            continue
        for r in ranks:
            nodes[topo.ranks[r]]["reduce_bandwidth"] = format_bandwidth(f.measured)
        changes.append(f"reduce_bandwidth of {f.where}: {format_bandwidth(f.expected)} -> "
                       f"{format_bandwidth(f.measured)}")

    tolerance = found[0].tolerance if found else 0.0
    said = f"{data['description'].rstrip()}\n" if data.get("description") else ""
    described = (f"{said}Bandwidths and reduction rates measured by `ddl topo probe --write` where they "
                 f"differed from {topo.source or topo.name} by more than {tolerance:.0%}: {len(changes)} "
                 f"change{'' if len(changes) == 1 else 's'}.")
    rest = {key: value for key, value in data.items() if key not in ("name", "description")}
    return {"name": data["name"], "description": described, **rest}, changes, notes

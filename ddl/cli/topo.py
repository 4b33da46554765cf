"""``ddl topo``: validate, show, draw and import topology files.

* ``ddl topo validate FILE...`` loads every file; one ``FILE: ok (N ranks, M hosts)`` line per good file
  on stdout, one line per bad file on stderr, exit status 2 when any file is bad.
* ``ddl topo show FILE`` prints what the planner sees: ranks per host, tiers (single-linkage clustering
  of ranks by link bandwidth), each rank's link bandwidth and the cut that limits collectives
  (ForestColl's bound, :func:`ddl.bounds.cut_bound`).
* ``ddl topo draw FILE -o out.png`` draws the fabric in layers: ranks at the bottom, then every vertex
  at its hop distance from the ranks (PCIe switches, hosts, NICs, leaf switches, spines); link width
  grows with the logarithm of the bandwidth and colour encodes it too.
* ``ddl topo probe FILE`` measures the fabric under an MPI job against the file (:mod:`ddl.probe`).
* ``ddl topo import FILE -o cluster.yaml`` writes a topology file from one node's ``nvidia-smi topo
  -m`` (:mod:`ddl.nvidia_smi`) or NCCL's topology XML (:mod:`ddl.nccl_xml`), for as many such nodes
  as ``--hosts`` says.
"""
import math
import os
import pathlib
import sys
from collections import Counter, OrderedDict, defaultdict, deque

from .. import bounds
from .. import nvidia_smi
from ..node_import import DEFAULT_CPU_LINK, parse_rate
from ..errors import Error
from ..units import counted, format_bandwidth
from . import check_output_file, same_file_as_any
from .argtypes import at_least, list_of, reported

KIND_STYLE = OrderedDict([
    # kind: (face colour, marker)
    ("gpu", ("#76b900", "s")),
    ("cpu", ("#1f77b4", "s")),
    ("pcie", ("#8c564b", "D")),
    ("nic", ("#ff7f0e", "D")),
    ("host", ("#7f7f7f", "o")),
    ("switch", ("#9467bd", "o")),
])
OTHER_STYLE = ("#bcbd22", "o")
MAX_DPI = 1200             # ddl topo draw --dpi: beyond this a raster image of a cluster is gigabytes


def register(subparsers):
    parser = subparsers.add_parser(
        "topo", help="validate, show, draw, import and probe topology files",
        description="Validate, inspect and draw topology files (YAML or JSON; see topologies/), make "
                    "one from `nvidia-smi topo -m` or NCCL's topology XML, or measure the fabric under "
                    "an MPI job against one.")
    sub = parser.add_subparsers(dest="topo_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: _no_subcommand(parser))

    p = sub.add_parser("validate", help="check topology files",
                       description="Load every FILE. Prints 'FILE: ok (N ranks, M hosts)' for each good "
                                   "file on stdout and one line per bad file on stderr; exit status 2 "
                                   "when any file is bad.")
    p.add_argument("files", nargs="+", metavar="FILE", help="topology file (.yaml, .yml or .json)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("show", help="summarise a topology: ranks, hosts, tiers, limiting cut",
                       description="Print a topology's ranks per host, its bandwidth tiers, each "
                                   "rank's links and the cut that limits collectives (ForestColl's "
                                   "allgather bound).")
    p.add_argument("file", metavar="FILE", help="topology file")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("draw", help="draw a topology to an image",
                       description="Draw a topology in layers (ranks at the bottom, switches on top); "
                                   "link width and colour grow with bandwidth. The format follows the "
                                   "output's extension (png, svg, pdf).")
    p.add_argument("file", metavar="FILE", help="topology file")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="image to write (default: FILE's name with .png, in the current directory)")
    p.add_argument("--dpi", type=int, default=120, help=f"resolution of raster images (default 120, at most {MAX_DPI})")
    p.set_defaults(func=cmd_draw)

    p = sub.add_parser("import", help="make a topology file from `nvidia-smi topo -m` or NCCL's topology XML",
                       description="Write a topology file for HOSTS machines like the one that FILE "
                                   "describes, from `nvidia-smi topo -m` or from the XML that NCCL writes "
                                   "to NCCL_TOPO_DUMP_FILE: its GPUs (the ranks), their NVLinks or "
                                   "NVSwitch, its PCIe switches and NUMA nodes, its NICs, the hosts' NICs "
                                   "joined by one switch. nvidia-smi gives no speeds: --gpu gives NVLink's "
                                   "and PCIe's, --nic-bandwidth the NICs'. The file's header says what was "
                                   "read and what assumed.")
    p.add_argument("file", metavar="FILE",
                   help="one node's `nvidia-smi topo -m`, or NCCL's topology XML ('-': read standard input)")
    p.add_argument("-o", "--output", metavar="OUT.yaml", help="file to write (default: standard output)")
    p.add_argument("--name", help="the topology's name (default: OUT's or FILE's name)")
    p.add_argument("--gpu", choices=tuple(nvidia_smi.GPU_PRESETS),
                   help="nvidia-smi: the GPUs' generation, for NVLink's rate per link and PCIe's: "
                        + "; ".join(f"{k}: {v.what}" for k, v in nvidia_smi.GPU_PRESETS.items()))
    p.add_argument("--nvlink", type=_rate("--nvlink"), metavar="BW",
                   help="NVLink rate per link per direction (instead of --gpu's or the XML's GPUs')")
    p.add_argument("--pcie", type=_rate("--pcie"), metavar="BW",
                   help="PCIe rate per direction of every GPU's slot and switch's uplink (instead of --gpu's "
                        "or the XML's)")
    p.add_argument("--cpu-link", type=_rate("--cpu-link"), default=DEFAULT_CPU_LINK,
                   metavar="BW", help="each NUMA node's link to the others (QPI, UPI, xGMI; default 38.4 GB/s)")
    p.add_argument("--hosts", type=at_least(1), default=1, metavar="N",
                   help="how many machines like this one the job runs on (default 1)")
    p.add_argument("--nic-bandwidth", type=_rate("--nic-bandwidth"), metavar="BW",
                   help="the NICs' rate (e.g. 200Gbit/s; instead of the XML's); nvidia-smi: puts them in the file, "
                        "needed with --hosts")
    p.add_argument("--nics", type=list_of(str), metavar="LIST",
                   help="the NICs that carry the job, by name (mlx5_0,mlx5_1; nvidia-smi: or column; default all)")
    p.add_argument("--gpus", type=list_of(at_least(0)), metavar="LIST",
                   help="the GPUs that are ranks, by index (0,1,4,5; default all)")
    p.add_argument("--nvlink-domain", type=at_least(1), metavar="N",
                   help="multi-node NVLink: N hosts in a row share their NVSwitches (18 trays of a GB200 NVL72 "
                        "rack; default: each host its own); must divide --hosts")
    p.add_argument("--nvswitch", choices=("auto", "yes", "no"), default="auto",
                   help="nvidia-smi: whether the GPUs' NVLinks go through NVSwitches (auto: when every "
                        "pair shows the same NV# and more links than a GPU has)")
    p.set_defaults(func=cmd_import)

    from .topo_probe import add_parser
    add_parser(sub)


def _rate(option):
    return reported(lambda text: parse_rate(text, option))


def _no_subcommand(parser):
    parser.print_help(sys.stderr)
    return 2


def _load(path):
    from ..topology import Topology  # imported late: `ddl --help` must work without it
    return Topology.load(path)


# ----------------------------------------------------------------------------------------------------
# validate


def cmd_validate(args):
    bad = 0
    for path in args.files:
        try:
            topo = _load(path)
        except Error as exc:
            bad += 1
            _error_line(path, str(exc))
            continue
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            bad += 1
            _error_line(path, exc.strerror or str(exc))
            continue
        print(f"{path}: ok ({counted(topo.nranks, 'rank')}, {counted(len(topo.hosts), 'host')})")
    return 2 if bad else 0


def _error_line(path, message):
    message = " ".join(message.split())  # exactly one line per bad file
    if not message.startswith(str(path)):
        message = f"{path}: {message}"
    print(message, file=sys.stderr)


# ----------------------------------------------------------------------------------------------------
# show


def compact_ranges(indices):
    """[0, 1, 2, 3, 8, 10, 11] -> '0-3,8,10-11'."""
    out = []
    items = sorted(indices)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def _group_sizes(groups):
    counts = Counter(len(g) for g in groups)
    parts = []
    for size, n in sorted(counts.items(), key=lambda kv: (-kv[0], kv[1])):
        parts.append(f"{counted(n, 'group')} of {size}")
    return " + ".join(parts)


def _abbreviate(items, head=6, tail=2):
    items = list(items)
    if len(items) <= head + tail + 1:
        return items
    return items[:head] + [f"  ... ({len(items) - head - tail} more)"] + items[-tail:]


def describe(topo):
    """Lines of ``ddl topo show``."""
    lines = []
    src = f"  ({topo.source})" if topo.source else ""
    lines.append(f"topology: {topo.name}{src}")
    description = getattr(topo, "description", None)
    if description:
        lines.append("  " + " ".join(str(description).split()))
    kinds = Counter(topo.kind(v) for v in topo.nodes)
    lines.append(f"vertices: {len(topo.nodes)} ("
                 + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
                 + f"), links: {sum(l.count for l in topo.links)}")

    rank_kinds = Counter(topo.kind(v) for v in topo.ranks)
    lines.append(f"ranks: {topo.nranks} (" + ", ".join(f"{n} {k}" for k, n in rank_kinds.items()) + ")")
    hosts = topo.hosts
    no_host = [i for i in range(topo.nranks) if topo.host_of(i) is None]
    by_layout = OrderedDict()
    for h, ranks in hosts.items():
        by_layout.setdefault(len(ranks), []).append(h)
    sizes = ", ".join(f"{len(hs)} x {counted(n, 'rank')}" for n, hs in by_layout.items())
    lines.append(f"hosts: {len(hosts)}" + (f" ({sizes})" if hosts else ""))
    host_lines = [f"  {h}: ranks {compact_ranges(r)}" for h, r in hosts.items()]
    lines.extend(_abbreviate(host_lines))
    if no_host:
        lines.append(f"  (no host): ranks {compact_ranges(no_host)}")

    lines.append("tiers (fastest first; single-linkage groups of ranks by bandwidth):")
    for k, tier in enumerate(topo.tiers):
        groups = tier.groups
        detail = ""
        if 1 < len(groups) <= 8:
            detail = "  " + " ".join(f"[{compact_ranges(g)}]" for g in groups)
        rate = format_bandwidth(tier.bandwidth) if math.isfinite(tier.bandwidth) else "-"   # (one rank: no link)
        lines.append(f"  {k}: {rate:>11}  {_group_sizes(groups)}{detail}")

    g = topo.usable_graph()                  # (a GPU outside the job forwards nothing: its links are left out)
    unusable = topo.graph.number_of_nodes() - g.number_of_nodes()
    lines.append("rank links (sum of link bandwidth per direction at the rank's vertex"
                 + (", to vertices that can carry the job's traffic" if unusable else "") + "):")
    summary = OrderedDict()
    links_at = Counter()                      # (one pass over the links, not one per rank)
    for link in topo.links:
        if link.a in g and link.b in g:
            links_at[link.a] += link.count
            if link.b != link.a:
                links_at[link.b] += link.count
    for i, v in enumerate(topo.ranks):
        out_bw = sum(g.edges[v, u]["capacity"] for u in g.successors(v))
        in_bw = sum(g.edges[u, v]["capacity"] for u in g.predecessors(v))
        nlinks = links_at[v]
        to_kind = Counter()
        for u in g.successors(v):
            to_kind[topo.kind(u)] += g.edges[v, u]["capacity"]
        split = tuple(sorted(to_kind.items(), key=lambda kv: -kv[1]))
        summary.setdefault((out_bw, in_bw, nlinks, split), []).append(i)
    rows = []
    for (o, n, c, split), r in summary.items():
        detail = ""
        if len(split) > 1:
            detail = " (out: " + ", ".join(f"{format_bandwidth(b)} to {k}" for k, b in split) + ")"
        rows.append(f"  ranks {compact_ranges(r)}: {format_bandwidth(o)} out, {format_bandwidth(n)} in, "
                    f"{counted(c, 'link')}{detail}")
    lines.extend(_abbreviate(rows))

    cut = _cut_line(topo)
    if cut:
        lines.extend(cut)
    return lines


def _cut_line(topo):
    if topo.nranks < 2:
        return ["limiting cut: none (a single rank)"]
    cb = bounds.cut_bound(topo)
    p = topo.nranks
    spb = cb.seconds_per_byte
    if spb <= 0 or math.isinf(spb):
        return [f"limiting cut: none found (allgather time per byte {spb})"]
    in_ranks = [i for i, v in enumerate(topo.ranks) if v in cb.cut]
    others = len(cb.cut) - len(set(topo.ranks[i] for i in in_ranks))
    outside = [i for i in range(p) if i not in set(in_ranks)]
    if len(outside) <= len(in_ranks):
        where = f"all ranks but {compact_ranges(outside)}"
    else:
        where = f"ranks {compact_ranges(in_ranks)}"
    ab = bounds.allreduce_bound(topo)
    tb = bounds.transfer_bound(topo)
    groups = len(ab.groups)
    why = ("the min cut: every byte crosses it each way" if ab.crossings == 1 else
           f"{groups} groups of ranks, every byte crosses between them {ab.crossings} times")
    allreduce_algbw = ab.algbw
    direct = (f"{len(tb.groups)} groups of ranks exchange at most {format_bandwidth(tb.bandwidth)} in all, "
              f"ranks joined by a direct link over it alone")
    if 2 * tb.seconds_per_byte > ab.seconds_per_byte:
        allreduce_algbw, why = 0.5 / tb.seconds_per_byte, direct

    def one_way(seconds_per_byte, names, what):
        """The line of a collective that moves every block one way: its cut's (or the transfer bound)."""
        bw, note = 1.0 / seconds_per_byte, f"; {what}" if what else ""
        if tb.seconds_per_byte > seconds_per_byte:
            bw, note = 1.0 / tb.seconds_per_byte, f"; {direct}"
        return f"  {names} algbw <= {format_bandwidth(bw)} (busbw <= {format_bandwidth(bw * (p - 1) / p)}{note})"

    # reduce-scatter's cut is the reversed fabric's: the same on full-duplex fabrics, not where a
    # link is faster one way than the other
    rs = bounds.cut_bound(topo, reverse=True).seconds_per_byte
    same = math.isclose(rs, spb, rel_tol=1e-9)
    return [
        f"limiting cut (ForestColl): S holds {cb.ranks_in_cut} of {counted(p, 'rank')} ({where}; plus "
        f"{counted(others, 'other vertex', 'other vertices')}), {format_bandwidth(cb.bandwidth_out)} leaves S",
        *([one_way(spb, "allgather / reduce-scatter", "")] if same else
          [one_way(spb, "allgather", ""),
           one_way(rs, "reduce-scatter", "its cut on the fabric reversed: links differ by direction")]),
        f"  allreduce algbw <= {format_bandwidth(allreduce_algbw)} "
        f"(busbw <= {format_bandwidth(allreduce_algbw * 2 * (p - 1) / p)}; {why})",
    ]


def cmd_show(args):
    topo = _load(args.file)
    print("\n".join(describe(topo)))
    return 0


# ----------------------------------------------------------------------------------------------------
# draw


def layout(topo):
    """Vertex -> (x, layer). Layer 0: ranks and GPUs; others by hop distance from layer 0, in the
    undirected fabric. Layer 0 is ordered by host then file order; upper layers by the barycentre of
    their neighbours below. Vertices reached by no link get the layer above everything else (host
    vertices that only name a group of ranks are left out: the host boxes show them)."""
    g = topo.graph.to_undirected(as_view=True)
    rank_set = set(topo.ranks)
    base = [v for v in topo.nodes if v in rank_set or topo.kind(v) == "gpu"]
    dist = {v: 0 for v in base}
    queue = deque(base)
    while queue:
        u = queue.popleft()
        for w in g.neighbors(u):
            if w not in dist:
                dist[w] = dist[u] + 1
                queue.append(w)
    top = max(dist.values(), default=0)
    hosts = set(topo.hosts)
    for v in topo.nodes:
        if v not in dist and not (topo.kind(v) == "host" and v in hosts and g.degree(v) == 0):
            dist[v] = top + 1

    # order layer 0 by host key (first appearance), then file order
    rank_index = {v: i for i, v in enumerate(topo.ranks)}
    file_pos = {v: k for k, v in enumerate(topo.nodes)}
    base_set = set(base)
    def host_key(v):
        if v in rank_index:
            h = topo.host_of(rank_index[v])
            if h is not None:
                return h
        if "/" in v:
            return v.split("/", 1)[0]
        # no host: group by the first vertex above it (the leaf switch of a fat tree)
        above = sorted((w for w in g.neighbors(v) if w not in base_set), key=file_pos.get)
        return above[0] if above else ""
    order_keys = OrderedDict()
    for v in base:
        order_keys.setdefault(host_key(v), len(order_keys))
    layer0 = sorted(base, key=lambda v: (order_keys[host_key(v)], file_pos[v]))
    x = {}
    gap = 0.6  # extra space between hosts
    pos = 0.0
    prev = None
    for v in layer0:
        k = host_key(v)
        if prev is not None and k != prev:
            pos += gap
        x[v] = pos
        pos += 1.0
        prev = k
    width = max(pos - 1.0, 1.0)

    layers = defaultdict(list)
    for v in topo.nodes:
        if v in dist and dist[v] > 0:
            layers[dist[v]].append(v)
    for d in sorted(layers):
        verts = layers[d]
        bary = {}
        for v in verts:
            below = [x[w] for w in g.neighbors(v) if w in x and dist.get(w, d) < d]
            bary[v] = sum(below) / len(below) if below else None
        known = [b for b in bary.values() if b is not None]
        fallback = sum(known) / len(known) if known else width / 2
        verts.sort(key=lambda v: (bary[v] if bary[v] is not None else fallback, file_pos[v]))
        want = [bary[v] if bary[v] is not None else fallback for v in verts]
        n = len(verts)
        min_gap = max(min(1.0, width / n), 0.5 * width / n)  # few vertices on a layer: spread out
        placed = _spread(want, min_gap)
        for v, px in zip(verts, placed):
            x[v] = px
    return {v: (x[v], dist[v]) for v in x}, layer0


def _spread(want, gap):
    """Positions as close to ``want`` (sorted) as possible, at least ``gap`` apart, centred like it."""
    if not want:
        return []
    out = [want[0]]
    for w in want[1:]:
        out.append(max(w, out[-1] + gap))
    shift = (sum(want) / len(want)) - (sum(out) / len(out))
    return [p + shift for p in out]


def _link_label(link):
    bw = format_bandwidth(link.bandwidth)
    return f"{link.count}x{bw}" if link.count > 1 else bw


class _Labels:
    """Greedy label placement: a label goes to the first candidate spot whose box (estimated from the
    text length and font size) overlaps no label placed before."""

    def __init__(self, ax, x_in, y_in):
        self.ax, self.x_in, self.y_in = ax, x_in, y_in  # inches per data unit
        self.boxes = []

    def box(self, x, y, text, size, ha="center", va="center", pad=0.02):
        w = (len(text) * size * 0.6 / 72 + 2 * pad) / self.x_in
        h = (size * 1.25 / 72 + 2 * pad) / self.y_in
        x0 = {"center": x - w / 2, "left": x, "right": x - w}[ha]
        y0 = {"center": y - h / 2, "bottom": y, "top": y - h}[va]
        return (x0, y0, x0 + w, y0 + h)

    def free(self, box):
        return not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3]
                       for b in self.boxes)

    def reserve(self, box):
        self.boxes.append(box)

    def place(self, candidates, text, size, force=False, **style):
        """Put ``text`` at the first free spot of ``candidates`` ((x, y) or (x, y, ha, va)); with
        ``force`` at the first one anyway. Returns True when placed."""
        def spot(c):
            return c if len(c) == 4 else (c[0], c[1], style.get("ha", "center"), style.get("va", "center"))
        for c in candidates:
            x, y, ha, va = spot(c)
            bx = self.box(x, y, text, size, ha, va)
            if self.free(bx):
                break
        else:
            if not force or not candidates:
                return False
            x, y, ha, va = spot(candidates[0])
            bx = self.box(x, y, text, size, ha, va)
        self.reserve(bx)
        style = dict(style, ha=ha, va=va)
        self.ax.text(x, y, text, fontsize=size, zorder=6, **style)
        return True


def draw(topo, output, dpi=120):
    """Write a picture of ``topo`` to ``output`` (format by extension)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap, LogNorm
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, PathPatch, Rectangle
    from matplotlib.path import Path

    pos, layer0 = layout(topo)
    rank_index = {v: i for i, v in enumerate(topo.ranks)}
    links = [l for l in topo.links if l.a in pos and l.b in pos]
    nlayers = max((d for _, d in pos.values()), default=0) + 1
    xs = [p[0] for p in pos.values()]
    xmin, xmax = min(xs), max(xs)
    span = max(xmax - xmin, 1.0)
    arc_depth = [0.16 + 0.1 * abs(pos[l.b][0] - pos[l.a][0]) ** 0.7 / max(1.0, span / 12)
                 for l in links if pos[l.a][1] == pos[l.b][1] == 0]
    ylo = min([-0.45] + [-d - 0.12 for d in arc_depth])
    yhi = nlayers - 0.35
    fig_w = min(max(9.0, 0.34 * span + 4.0), 22.0)
    fig_h = min(max(4.5, 1.7 * (yhi - ylo) + 1.4), 12.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    ax_frac_w, ax_frac_h = 0.74, 0.84  # of the figure, after the legend and colour bar
    x_in = fig_w * ax_frac_w / (span + 2.0)
    y_in = fig_h * ax_frac_h / (yhi - ylo)
    labels = _Labels(ax, x_in, y_in)
    dense = x_in < 0.22

    # link colours and widths: log of the bandwidth of the link group (count x bandwidth)
    bws = [l.bandwidth * l.count for l in links] or [1.0]
    bmin, bmax = min(bws), max(bws)
    norm = LogNorm(vmin=bmin, vmax=bmax if bmax > bmin else bmin * 10)
    base = plt.get_cmap("viridis")
    cmap = LinearSegmentedColormap.from_list("ddl_bw", [base(0.88 - 0.88 * t) for t in
                                                        [k / 15 for k in range(16)]])
    def width(bw):
        if bmax <= bmin:
            return 2.0
        return 0.9 + 3.1 * (math.log(bw) - math.log(bmin)) / (math.log(bmax) - math.log(bmin))

    # host boxes behind layer 0
    xpos = {v: pos[v][0] for v in layer0}
    host_boxes = []
    for h, ranks in topo.hosts.items():
        vs = [topo.ranks[i] for i in ranks if topo.ranks[i] in xpos]
        if vs:
            host_boxes.append((h, min(xpos[v] for v in vs) - 0.45, max(xpos[v] for v in vs) + 0.45))
    for h, lo, hi in host_boxes:
        ax.add_patch(Rectangle((lo, -0.3), hi - lo, 0.6, facecolor="#ececec", edgecolor="#9a9a9a",
                               linewidth=0.7, zorder=0))

    # vertices (and their labels first, so that link labels avoid them)
    msize = max(3.0, min(15.0, 45 * x_in))
    layer_count = Counter(d for _, d in pos.values())
    kinds_seen = OrderedDict()
    number_ranks = msize >= 9.0
    for v, (x, y) in pos.items():
        kind = topo.kind(v)
        face, marker = KIND_STYLE.get(kind, OTHER_STYLE)
        kinds_seen[kind] = (face, marker)
        is_rank = v in rank_index
        ax.plot([x], [y], marker=marker, markersize=msize if y == 0 else min(msize * 1.2, 15.0),
                markerfacecolor=face if (is_rank or y > 0) else "white",
                markeredgecolor="black" if is_rank else "#333333", markeredgewidth=0.6,
                linestyle="none", zorder=3)
        labels.reserve(labels.box(x, y, "MM", msize * 0.9))
        if y == 0:
            if is_rank and number_ranks:
                ax.text(x, y, str(rank_index[v]), fontsize=min(6.5, msize * 0.45), ha="center",
                        va="center", zorder=4, color="black" if kind != "cpu" else "white")
            elif not is_rank and not dense:
                ax.text(x, y, v.rsplit("/", 1)[-1], fontsize=5, ha="center", va="center", zorder=4)
    for v, (x, y) in pos.items():
        crowded = layer_count[y] > 16
        if y > 0 and (not crowded or (topo.kind(v) in ("switch", "cpu") and layer_count[y] <= 24)):
            name = v if len(v) <= 16 else v.rsplit("/", 1)[-1]
            dx = 0.6 * msize / 72 / x_in
            labels.place([(x, y + 0.17, "center", "bottom"), (x, y - 0.17, "center", "top"),
                          (x + dx, y + 0.05, "left", "bottom"), (x - dx, y + 0.05, "right", "bottom")],
                         name, 7, bbox=dict(boxstyle="round,pad=0.1", facecolor="white",
                                            edgecolor="none", alpha=0.75))
    fits = all(len(h) * 6.5 * 0.6 / 72 <= (hi - lo) * x_in for h, lo, hi in host_boxes)
    for h, lo, hi in host_boxes:
        if fits:
            labels.place([((lo + hi) / 2, 0.31)], h, 6.5, ha="center", va="bottom", color="#333333",
                         bbox=dict(boxstyle="round,pad=0.1", facecolor="#ececec", edgecolor="none",
                                   alpha=0.85))
        else:  # narrow box: the name runs down inside it, under the ranks
            ax.text((lo + hi) / 2, -0.05 - 0.5 * msize / 72 / y_in, h, fontsize=6, rotation=90,
                    ha="center", va="top", color="#333333", zorder=2)

    # links
    drawn = []  # (link, curve function t -> (x, y))
    for l in links:
        (xa, ya), (xb, yb) = pos[l.a], pos[l.b]
        bw = l.bandwidth * l.count
        color, lw = cmap(norm(bw)), width(bw) * (0.7 if dense else 1.0)
        if ya == yb:  # same layer: an arc below the row, deeper for longer spans
            depth = 0.16 + 0.1 * abs(xb - xa) ** 0.7 / max(1.0, span / 12)
            cx, cy = (xa + xb) / 2, ya - 2 * depth
            ax.add_patch(PathPatch(Path([(xa, ya), (cx, cy), (xb, yb)],
                                        [Path.MOVETO, Path.CURVE3, Path.CURVE3]),
                                   facecolor="none", edgecolor=color, linewidth=lw, alpha=0.85,
                                   zorder=1))
            curve = (lambda xa, ya, cx, cy, xb, yb: lambda t: (
                (1 - t) ** 2 * xa + 2 * t * (1 - t) * cx + t * t * xb,
                (1 - t) ** 2 * ya + 2 * t * (1 - t) * cy + t * t * yb))(xa, ya, cx, cy, xb, yb)
        else:
            if l.directed:
                ax.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="-|>", mutation_scale=9,
                                             color=color, linewidth=lw, alpha=0.85, zorder=1))
            else:
                ax.plot([xa, xb], [ya, yb], color=color, linewidth=lw, alpha=0.85, zorder=1,
                        solid_capstyle="round")
            curve = (lambda xa, ya, xb, yb: lambda t: (xa + t * (xb - xa), ya + t * (yb - ya)))(
                xa, ya, xb, yb)
        drawn.append((l, curve))

    # link labels: every link when few, else one per group of alike links (same layers, kinds and
    # bandwidth), each at the first spot along its link that no other label covers
    groups = OrderedDict()
    for l, curve in drawn:
        da, db = pos[l.a][1], pos[l.b][1]
        key = (min(da, db), max(da, db), tuple(sorted((topo.kind(l.a), topo.kind(l.b)))),
               l.bandwidth, l.count, l.directed)
        groups.setdefault(key, []).append((l, curve))
    label_all = len(drawn) <= 16
    ts = (0.5, 0.4, 0.6, 0.3, 0.7, 0.22, 0.78)
    style = dict(ha="center", va="center",
                 bbox=dict(boxstyle="round,pad=0.12", facecolor="white", edgecolor="none", alpha=0.9))
    size = 6.5
    for key, members in groups.items():
        mid = len(members) // 2
        ordered = members[mid:] + members[:mid]
        wanted = len(members) if (label_all or len(members) <= 2) else 1
        placed = 0
        for l, curve in ordered:
            if placed >= wanted:
                break
            if labels.place([curve(t) for t in ts], _link_label(l), size, **style):
                placed += 1
        if placed == 0:  # crowded: put it on the middle link anyway
            l, curve = ordered[0]
            labels.place([curve(0.5)], _link_label(l), size, force=True, **style)

    handles = [Line2D([0], [0], marker=m, color="none", markerfacecolor=f, markeredgecolor="black",
                      markersize=8, label=k) for k, (f, m) in kinds_seen.items()]
    if host_boxes:
        handles.append(Rectangle((0, 0), 1, 1, facecolor="#ececec", edgecolor="#9a9a9a",
                                 label="host (ranks inside)"))
    if any(topo.kind(v) == "gpu" and v not in rank_index for v in layer0):
        handles.append(Line2D([0], [0], marker="s", color="none", markerfacecolor="white",
                              markeredgecolor="#333333", markersize=8, label="gpu, not a rank"))
    ax.legend(handles=handles, loc="upper left", fontsize=7, frameon=True,
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, title="vertex kind", title_fontsize=7)
    if bmax > bmin:
        sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
        cbar = fig.colorbar(sm, ax=ax, fraction=0.025, pad=0.13, shrink=0.6, anchor=(0.0, 0.0))
        ticks = []
        for t in sorted(set(bws)):  # drop ticks that would print on top of each other
            if not ticks or math.log(t / ticks[-1]) > 0.12 * math.log(bmax / bmin):
                ticks.append(t)
        cbar.set_ticks(ticks)
        cbar.set_ticklabels([format_bandwidth(t) for t in ticks])
        cbar.ax.tick_params(labelsize=6)
        cbar.ax.minorticks_off()
        cbar.set_label("link bandwidth per direction (count x link)", fontsize=7)

    ax.set_title(f"{topo.name}: {counted(topo.nranks, 'rank')}, {counted(len(topo.hosts), 'host')}",
                 fontsize=11)
    ax.set_xlim(xmin - 1.0, xmax + 1.0)
    ax.set_ylim(ylo, yhi)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(output, dpi=dpi)
    plt.close(fig)
    return output


def cmd_draw(args):
    topo = _load(args.file)
    output = args.output if args.output is not None else os.path.splitext(os.path.basename(args.file))[0] + ".png"
    check_output_file("-o", output, "topo.png")
    if not os.path.splitext(output)[1]:
        output += ".png"               # what matplotlib would write: say so instead of another name
    if not 0 < args.dpi <= MAX_DPI:
        raise Error(f"--dpi {args.dpi}: from 1 to {MAX_DPI}")
    try:
        draw(topo, output, dpi=args.dpi)
    except ValueError as exc:  # unknown image format from matplotlib
        raise Error(f"{output}: {exc}") from None
    print(f"wrote {output}")
    return 0


# ----------------------------------------------------------------------------------------------------
# import


def cmd_import(args):
    import yaml

    from .. import nccl_xml
    from ..topology import Topology

    if args.output is not None:
        check_output_file("-o", args.output, "cluster.yaml")
        if args.file != "-" and same_file_as_any(args.output, [args.file]):
            raise Error(f"-o {args.output} is the file being imported: name another file for the topology")
    source = "<stdin>" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else pathlib.Path(args.file).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise Error(f"{source}: not text; give the output of `nvidia-smi topo -m` or NCCL's topology XML") from None
    name = args.name or os.path.splitext(os.path.basename(args.output or source))[0].strip("<>")
    common = dict(nvlink=args.nvlink, pcie=args.pcie, cpu_link=args.cpu_link, hosts=args.hosts,
                  nic_bandwidth=args.nic_bandwidth, nics=args.nics, gpus=args.gpus, nvlink_domain=args.nvlink_domain)
    if text.lstrip().startswith("<"):
        matrix_only = [option for option, given in (("--gpu", args.gpu), ("--nvswitch", args.nvswitch != "auto"))
                       if given]
        if matrix_only:
            raise Error(f"{' and '.join(matrix_only)} {'are' if len(matrix_only) > 1 else 'is'} for an nvidia-smi "
                        f"matrix; NCCL's XML says its GPUs' generation and NVSwitches itself (--nvlink and --pcie "
                        f"replace its rates)")
        out = nccl_xml.topology(nccl_xml.read_xml(text, source), name, source, **common)
    else:
        out = nvidia_smi.topology(nvidia_smi.read_matrix(text, source), name, gpu=args.gpu,
                                  nvswitch=args.nvswitch, **common)
    topo = Topology.from_dict(yaml.safe_load(out), source=args.output or "<output>")
    if args.output is None:
        sys.stdout.write(out)
        return 0
    from ..schedule import write_file
    write_file(args.output, out)
    print(f"{args.output}: {counted(topo.nranks, 'rank')} on {counted(len(topo.hosts), 'host')}; see it "
          f"with `ddl topo show {args.output}`", file=sys.stderr)
    return 0

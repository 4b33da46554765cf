"""How ``ddl bench`` shows what it measured: the nccl-tests-style table (one line per row, the column
widths fixed before the first row is printed, since rows come one by one), the ``--links`` and
``--trace`` blocks under each size's rows, the footer with ddl's speed-up over each peer, and the plot.

Pure formatting of the row dicts :mod:`ddl.bench` builds (the ``--json`` records): no MPI here.
"""
import os

from .errors import Error
from .planner import FLAT_BANDWIDTH
from .units import format_seconds, format_size

COLUMNS = ("size", "count", "type", "redop", "impl", "time", "algbw", "busbw", "#wrong",
           "algorithm", "predicted", "bound", "t/pred", "t/bound")


LINK_LINES = 10
"""Links the table shows per size (the busiest); ``--json`` has them all."""


def link_lines(rows):
    """The ``--links`` block under one size's rows: bytes per iteration on the busiest emulated links,
    for every implementation, and the data ddl's schedule planned there."""
    measured = [r for r in rows if r.get("link_bytes")]
    if not measured:
        return []
    plan = next((r for r in measured if r.get("link_bytes_planned")), None)
    names = sorted(measured[0]["link_bytes"], key=lambda k: -max(r["link_bytes"][k] for r in measured))
    heads = [r["impl"] for r in measured] + ([f"{plan['impl']} plan"] if plan else [])
    width = max(len(n) for n in names)
    cols = [max(11, len(h)) for h in heads]
    planned = "; plan: the data ddl's schedule puts there" if plan else ""
    lines = [f"# bytes per iteration on the emulated links (tc counters: frames with their headers and TCP's "
             f"acknowledgements{planned})",
             "#   " + f"{'link':<{width}}" + "".join(f" {h:>{c}}" for h, c in zip(heads, cols))]
    for name in names[:LINK_LINES]:
        cells = [r["link_bytes"][name] for r in measured] + ([plan["link_bytes_planned"][name]] if plan else [])
        lines.append("#   " + f"{name:<{width}}" +
                     "".join(f" {format_size(round(b)):>{c}}" for b, c in zip(cells, cols)))
    if len(names) > LINK_LINES:
        lines.append(f"#   ... and {len(names) - LINK_LINES} less busy links (--json lists every link)")
    return lines


def trace_lines(rows):
    """The ``--trace`` lines under one size's rows: when, in a median call, each traced implementation's
    agreement ended, its first and last message between hosts arrived, and the call ended."""
    lines = []
    for row in rows:
        t = row.get("trace")
        if not t:
            continue
        parts = []
        if t["agreement"] is not None:
            parts.append(f"agreement done on every rank after {format_seconds(t['agreement'])}")
        if t["first_message"] is not None:
            parts.append(f"messages between {t['between']} arrived from {format_seconds(t['first_message'])} "
                         f"to {format_seconds(t['last_message'])}")
        else:
            parts.append(f"no messages between {t['between']}")
        if t["end"] is not None:
            parts.append(f"done after {format_seconds(t['end'])}")
        lines.append(f"# trace {row['impl']}: " + "; ".join(parts) + " (times after the first rank's call, "
                     "medians over the iterations)")
    return lines


_WIDTHS = (12, 11, 8, 6, 10, 10, 10, 10, 7, 18, 10, 10, 7, 8)
_LEFT = (4, 9)  # impl and algorithm are left-aligned


def widths_for(names):
    """Column widths: the impl column as wide as the longest implementation name, the algorithm column
    as the longest algorithm name (the rows come one by one, so every name must fit from the start)."""
    from .algorithms import ALGORITHMS
    w = list(_WIDTHS)
    w[4] = max(w[4], *(len(n) for n in names)) if names else w[4]
    w[9] = max(w[9], *map(len, ALGORITHMS))
    return tuple(w)


def _line(cells, widths):
    return " ".join(f"{c:<{w}}" if i in _LEFT else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def table_header(widths=_WIDTHS):
    """The table's two header lines: the column names, then their units."""
    units = ["(B)", "(elements)", "", "", "", "(median)", "(GB/s)", "(GB/s)", "", "", "", "", "", ""]
    return "#" + _line(COLUMNS, widths)[1:] + "\n" + ("#" + _line(units, widths)[1:]).rstrip()


def _bw(x):
    return "-" if x is None else f"{x / 1e9:.4g}"


def format_row(row, widths=_WIDTHS):
    """One table line (nccl-tests columns, then ddl's prediction and the bound)."""
    pred, bound, t = row["predicted_seconds"], row["bound_seconds"], row["seconds"]
    cells = [str(row["bytes"]), str(row["count"]), row["dtype"].replace("float32", "float"), row["op"],
             row["impl"], format_seconds(t), _bw(row["algbw"]), _bw(row["busbw"]), str(row["wrong"]),
             row["algorithm"] if row["impl"].startswith("ddl") else "-",
             format_seconds(pred) if pred else "-", format_seconds(bound) if bound else "-",
             f"{t / pred:.2f}" if pred else "-", f"{t / bound:.2f}" if bound else "-"]
    return _line(cells, widths)


BELOW_BOUND = 0.98
"""A time under this fraction of the bound gets a footnote (timing noise stays above it)."""
SLOWER_THAN_PREDICTED = 1.5
"""A ddl time over this multiple of its prediction, from :data:`SLOW_CHECK_BYTES` up, gets a footnote."""
SLOW_CHECK_BYTES = 1 << 20
"""(Below it the software cost of each message, which a file may not model, weighs as much as the links.)"""


def print_summary(rows, out, emulated=False, topology_file=None, mpi_library=""):
    """nccl-tests' footer, ddl's speed-up over each peer at each size, a note on any time under the
    bound, saying why it can be there (``emulated``: the rows ran on an emulated cluster), and one on
    ddl's times far over their predictions, pointing at ``ddl topo probe`` (``topology_file``: the file
    the run planned on; None: ddl's flat default) and, under Open MPI (``mpi_library``, what
    ``MPI_Get_library_version`` says) with its TCP BTL's eager limit and flags left at their
    defaults, at that limit (README, "Another MPI": ddl's pieces above it ran at 0.6 times the links'
    rate)."""
    bad = sum(r["wrong"] for r in rows)
    print(f"# wrong values (#wrong, all rows; nccl-tests' out of bounds values): {bad} "
          f"{'OK' if bad == 0 else 'FAILED'}", file=out)
    by_impl = {}
    for r in rows:
        if r["busbw"] is not None:
            by_impl.setdefault(r["impl"], []).append(r["busbw"])
    if by_impl:
        print("# avg bus bandwidth (GB/s): " + ", ".join(f"{k} {sum(v) / len(v) / 1e9:.4g}"
                                                       for k, v in by_impl.items()), file=out)
    for nbytes in sorted({r["bytes"] for r in rows}):
        at = {r["impl"]: r for r in rows if r["bytes"] == nbytes}
        ddl_row = at.get("ddl")
        peers = [r for r in at.values() if not r["impl"].startswith("ddl")]
        if ddl_row and peers and ddl_row["seconds"] > 0:
            ups = ", ".join(f"{p['seconds'] / ddl_row['seconds']:.2f}x {p['impl']}'s speed" for p in peers)
            print(f"# ddl ({ddl_row['algorithm']}) at {format_size(nbytes)}: {ups}", file=out)
    below = [f"{r['impl']} at {format_size(r['bytes'])} ({r['seconds'] / r['bound_seconds']:.2f})" for r in rows
             if r["bound_seconds"] and r["seconds"] < BELOW_BOUND * r["bound_seconds"]]
    if below:
        why = ("the emulated links let a burst of up to their token bucket (128 KiB or more) through at once, so "
               "what puts less on a link is not held to its rate" if emulated else
               "the fabric is faster than the topology file says, or the implementation reduces inside the "
               "switches (SHARP), which point-to-point transfers cannot")
        print(f"# under the bound: {', '.join(below)}: the bound holds for point-to-point transfers at the "
              f"file's rates; {why}", file=out)
    slow = [f"{r['impl']} at {format_size(r['bytes'])} ({r['seconds'] / r['predicted_seconds']:.2f})" for r in rows
            if r["impl"].startswith("ddl") and r["predicted_seconds"] and r["bytes"] >= SLOW_CHECK_BYTES
            and r["seconds"] > SLOWER_THAN_PREDICTED * r["predicted_seconds"]]
    if slow:
        why = (f"the prediction takes the file's rates; where the fabric carries less, `ddl topo probe "
               f"{topology_file}` under the same launch says which links (`--write OUT`: a copy with what it "
               f"measured)" if topology_file else
               f"with no topology file ddl planned and predicted for a flat network of {FLAT_BANDWIDTH} per "
               f"rank: give it the cluster's file (`ddl topo probe FILE --write OUT` checks one against the "
               f"fabric and writes the rates it measured)")
        print(f"# slower than predicted: {', '.join(slow)}: {why}", file=out)
        if mpi_library.startswith("Open MPI") and not any(
                f"OMPI_MCA_btl_tcp_{name}" in os.environ for name in ("eager_limit", "flags")):
            print("# under Open MPI over TCP (its tcp BTL), ddl's pieces above the BTL's eager limit (64 KiB "
                  "unless set) ran slower than the links: try `export OMPI_MCA_btl_tcp_eager_limit=1048576` "
                  "before mpiexec (README, \"Another MPI\")", file=out)


def plot(rows, path, title=""):
    """Bus bandwidth against size, one line per implementation (matplotlib, Agg)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Error("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    impls = []
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    for name in impls:
        pts = [(r["bytes"], (r["busbw"] or 0) / 1e9) for r in rows if r["impl"] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise Error(f"--plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)

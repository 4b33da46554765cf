"""Bring a Topology to life as Linux network namespaces, bridges, veth pairs and tbf shapers.

Why this shape (see the project's emulation notes for the measurements behind it):

* every emulated **host** is a network namespace *and* a UTS namespace with its own hostname, so MPI
  sees distinct nodes and ranks of different hosts cannot use shared memory between them;
* every **switch** is a Linux bridge (STP off, no forwarding delay) in one shared switch namespace;
* every host<->switch and switch<->switch link is a veth pair. Each direction is shaped with
  ``tbf`` on the device that *transmits* it (host ``eth0`` for host->switch, the switch port for
  switch->host, each uplink end for its direction): no ifb, no ingress policing needed;
* addresses come from 198.18.0.0/15 (benchmarking range) on one L2 segment, no routes, and nothing is
  attached to the root namespace, so no emulated packet can leave the machine.

The mapping (:func:`plan_network`) is pure and unit-testable; :class:`Cluster` executes it and tears it
down again, recording its state on disk first so that a crashed run can still be cleaned up.
"""
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import networkx as nx

from ..errors import Error
from ..units import format_bandwidth

STATE_ROOT = Path("/run/ddl-emulate")
"""Where clusters record themselves (tmpfs: a reboot, which also drops every namespace, clears it)."""

GSO_MAX_BYTES = 64 << 10
"""The largest packet TCP hands a veth at once (a GSO super-packet), headers included."""

TBF_MIN_BURST = 2 * GSO_MAX_BYTES
"""tbf bucket floor: room for a whole GSO super-packet as tbf measures it (:func:`gso_wire_bytes`).

tbf cuts a packet longer than its bucket into MTU-sized packets in software, and every one of them
then crosses the bridge and the peer veth on its own. It counts a GSO packet's length as if already
cut, each segment with its own headers: 68.5 KB for a full 64 KiB packet at MTU 1500. So a 64 KiB
bucket (the floor once) made the kernel segment nearly every packet, on a machine whose cores are what
binds an emulated cluster (softirq: TCP over veths, bridges and tbf). With 128 KiB, on the two-rack
cluster (64 MiB allreduce, four alternating runs), the kernel's time per run fell from 88-90 s to 70-71
s, ddl's allreduce from 6.30-6.33 s to 5.81-5.91 s and MPI_Allreduce's from 8.81-9.13 s to 7.54-8.15 s;
the shaped rates stay within 1% of the file's. Below 64 KiB the shaped rates come out wrong as well."""

TBF_BURST_SECONDS = 1e-3
"""Bucket of fast links: 1 ms worth of the rate. tc keeps the bucket as a time at its clock's
resolution, so a 64 KiB bucket on a 1.6 Tbit/s link rounds to zero and would drop everything."""

TBF_LATENCY_SECONDS = 0.02
"""tbf queue length expressed as delay: enough for TCP to fill the link, small enough to stay fair."""
TBF_LATENCY = f"{TBF_LATENCY_SECONDS * 1000:g}ms"     # as tc takes it
MAX_SHAPED_BITS = int(8 * (2 ** 32 - 1) / (TBF_BURST_SECONDS + TBF_LATENCY_SECONDS))
"""The fastest rate shaped as asked (1.6 Tbit/s): tbf holds its bucket and its queue (the rate times
:data:`TBF_LATENCY`, plus the bucket) in 32-bit byte counts. Above it tc refuses the bucket, or the
queue wraps round to a few hundred microseconds and the link drops what a fabric would queue."""
MIN_SHAPED_BITS = 8000
"""tc's smallest rate (8 kbit/s): a slower link is refused, not quietly run faster than the file says."""

MTU = 1500
"""Default frame size of the emulated links (Ethernet's). ``mtu=9000`` gives the jumbo frames many
cluster fabrics run: the kernel then handles about 5.6x fewer packets (a 64 MiB allreduce on the
two-rack cluster: 186 thousand against 1.05 million through the shapers), though on a 2-core machine
run-to-run variation hid any change in the times."""
MTU_RANGE = (1280, 65535)
"""Frame sizes a veth accepts (IPv6's minimum up to the veth driver's maximum)."""


def check_mtu(mtu):
    """``mtu`` as an int, or :class:`ddl.Error` saying which frame sizes a veth takes."""
    try:
        value = int(str(mtu).strip())
    except ValueError:
        value = None
    if value is None or not MTU_RANGE[0] <= value <= MTU_RANGE[1]:
        raise Error(f"--mtu must be a whole number of bytes from {MTU_RANGE[0]} to {MTU_RANGE[1]} "
                    f"(1500 is Ethernet's default, 9000 jumbo frames), got {mtu!r}")
    return value


def gso_wire_bytes(mtu):
    """The length tbf counts for TCP's largest GSO packet over frames of ``mtu`` bytes: the packet plus,
    for every segment after the first, the Ethernet, IP and TCP headers that segment will carry."""
    mss = mtu - 52
    segments = -(-GSO_MAX_BYTES // mss)
    return GSO_MAX_BYTES + (segments - 1) * (14 + 52)


def goodput(mtu):
    """TCP goodput over a tbf-shaped link, as a fraction of the tbf rate, for frames of ``mtu`` bytes:
    tbf counts the 14-byte Ethernet header, the payload loses 20 bytes of IP and 32 of TCP (with
    timestamps) header. 0.956 at 1500 and 0.993 at 9000, as measured.

    A topology file states what applications get from a link, and the planner, simulator and bounds
    use that figure, so links are shaped at ``rate / goodput``: the emulated cluster then delivers the
    file's bandwidth to MPI and measurements compare with predictions like for like."""
    return (mtu - 52) / (mtu + 14)


ADDRESS_PREFIX_LEN = 15
NAMED_KINDS = ("host", "switch")
COMMAND_TIMEOUT = 30.0
"""Seconds any single ip/tc/unshare invocation may take: they finish in milliseconds when healthy."""


# ----------------------------------------------------------------------------------------------------
# The plan: pure data derived from a Topology
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostPlan:
    """One emulated host: its namespace, hostname, address and the ranks it runs."""
    id: str
    index: int
    netns: str
    hostname: str
    address: str
    ranks: tuple
    switch: str = None          # switch id this host's eth0 attaches to (None: a lone host)
    port: str = None            # name of the switch-side veth end in the switch namespace
    rate_out: float = 0.0       # bytes/s host -> switch (tbf on eth0)
    rate_in: float = 0.0        # bytes/s switch -> host (tbf on the switch port)


@dataclass(frozen=True)
class UplinkPlan:
    """A switch<->switch link: veth ``end_a`` on bridge of ``a``, ``end_b`` on bridge of ``b``."""
    a: str
    b: str
    end_a: str
    end_b: str
    rate_ab: float              # bytes/s a -> b (tbf on end_a, which transmits towards b)
    rate_ba: float              # bytes/s b -> a (tbf on end_b)


@dataclass(frozen=True)
class NetworkPlan:
    """Everything needed to build (and later find and remove) one emulated cluster."""
    name: str
    tag: str                    # namespace name prefix, unique per cluster: ``ddl-<pid>``
    switch_netns: str
    hosts: tuple                # HostPlan, in topology node order
    bridges: dict = field(default_factory=dict)   # switch id -> bridge name
    uplinks: tuple = ()         # UplinkPlan
    mtu: int = MTU              # frame size of every veth

    def host(self, host_id):
        for h in self.hosts:
            if h.id == host_id:
                return h
        raise Error(f"cluster {self.name!r} has no host {host_id!r}")

    @property
    def namespaces(self):
        """Every namespace of the cluster, hosts first (the order teardown kills processes in)."""
        extra = (self.switch_netns,) if self.bridges else ()
        return tuple(h.netns for h in self.hosts) + extra

    def path_rate(self, src_host, dst_host):
        """Shaped rate (bytes/s) of the path from one host to another: the slowest tbf on the way."""
        if src_host == dst_host:
            return float("inf")
        a, b = self.host(src_host), self.host(dst_host)
        rates = [a.rate_out, b.rate_in]
        rates += [rate for _, _, rate in self._switch_hops(a.switch, b.switch)]
        return min(rates)

    def _switch_hops(self, sa, sb):
        graph = nx.Graph()
        graph.add_nodes_from(self.bridges)
        for u in self.uplinks:
            graph.add_edge(u.a, u.b, plan=u)
        path = nx.shortest_path(graph, sa, sb)
        for x, y in zip(path, path[1:]):
            u = graph.edges[x, y]["plan"]
            yield x, y, (u.rate_ab if (u.a, u.b) == (x, y) else u.rate_ba)

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        return cls(name=d["name"], tag=d["tag"], switch_netns=d["switch_netns"],
                   hosts=tuple(HostPlan(**{**h, "ranks": tuple(h["ranks"])}) for h in d["hosts"]),
                   bridges=dict(d["bridges"]), uplinks=tuple(UplinkPlan(**u) for u in d["uplinks"]),
                   mtu=int(d.get("mtu", MTU)))


def host_address(index):
    """Address of host ``index``: 198.18.0.10, .11, ... then 198.18.1.10 ... (240 per /24, never .0/.255)."""
    block, offset = divmod(index, 240)
    if block >= 512:
        raise Error(f"too many hosts to emulate ({index + 1}); 198.18.0.0/15 holds {512 * 240}")
    return f"198.{18 + block // 256}.{block % 256}.{10 + offset}"


def sanitize_hostname(host_id, taken):
    """A valid, unique hostname (RFC 1123 label) for a host id such as ``r0/h1`` -> ``r0-h1``."""
    base = re.sub(r"[^A-Za-z0-9-]+", "-", str(host_id)).strip("-")[:56] or "host"
    name, k = base, 1
    while name.lower() in taken:
        name, k = f"{base}-{k}", k + 1
    taken.add(name.lower())
    return name


def plan_network(topo, tag, scale=1.0, mtu=MTU):
    """Map a Topology to a :class:`NetworkPlan` (no side effects); every rate is multiplied by ``scale``,
    every veth gets frames of ``mtu`` bytes.

    Every ``host`` vertex becomes a namespace. A host *owns* the vertices inside it: those whose id
    starts with ``<host>/`` (or whose ``host`` attribute names it), and whatever hangs off them or off
    the host without passing another host or a network switch. A switch owned by a host (an NVSwitch,
    a PCIe switch) is internal; every other switch becomes a bridge. A host attaches to the network
    switch its vertices link to, at the max-flow rate from its ranks to that switch each way: the
    bottleneck of a nic/pcie chain, the sum of parallel NICs. Raises :class:`ddl.Error` for what one L2
    segment cannot carry: no hosts, a rank without a host, a host on several switches, host-to-host
    cables, switch loops, disconnected switches.
    """
    if not 0 < scale < math.inf:
        raise Error(f"bandwidth scale must be a positive number, got {scale}")
    mtu = check_mtu(mtu)
    hosts = [v for v in topo.nodes if topo.kind(v) == "host"]
    if not hosts:
        raise Error(f"topology {topo.name!r} has no node of kind 'host': nothing to emulate "
                    "(give each machine a {id: ..., kind: host} node and link its devices to it)")
    _check_ranks_have_hosts(topo)
    owned = ownership(topo, hosts)
    switches = [v for v in topo.nodes if topo.kind(v) == "switch" and v not in owned]
    attach = {h: _attachment(topo, h, owned, set(switches)) for h in hosts}
    _check_connected(topo, hosts, switches, attach)

    bridges = {s: f"br{k}" for k, s in enumerate(switches)}
    taken = set()
    host_plans = []
    for i, h in enumerate(hosts):
        sw, out_rate, in_rate = attach[h]
        host_plans.append(HostPlan(
            id=h, index=i, netns=f"{tag}-h{i}", hostname=sanitize_hostname(h, taken),
            address=host_address(i), ranks=tuple(topo.hosts.get(h, ())), switch=sw,
            port=f"h{i}" if sw is not None else None, rate_out=out_rate * scale, rate_in=in_rate * scale))
    uplinks = tuple(replace(u, rate_ab=u.rate_ab * scale, rate_ba=u.rate_ba * scale)
                    for u in _uplinks(topo, switches))
    _check_shapeable(host_plans, uplinks, scale, mtu)
    return NetworkPlan(name=topo.name, tag=tag, switch_netns=f"{tag}-sw", hosts=tuple(host_plans),
                       bridges=bridges, uplinks=uplinks, mtu=mtu)


def _check_shapeable(host_plans, uplinks, scale, mtu):
    """Every direction of every link must get a rate tc can set, or the emulated cluster would not be
    the file's: refuse one faster than tc's 64-bit rate or slower than its 8 kbit/s floor."""
    links = [(f"host {h.id!r} -> switch {h.switch!r}", h.rate_out) for h in host_plans if h.switch]
    links += [(f"switch {h.switch!r} -> host {h.id!r}", h.rate_in) for h in host_plans if h.switch]
    links += [(f"switch {a!r} -> switch {b!r}", rate) for u in uplinks
              for a, b, rate in ((u.a, u.b, u.rate_ab), (u.b, u.a, u.rate_ba))]
    if not links:
        return
    if max(shaped_bits(rate, mtu) for _, rate in links) >= MAX_SHAPED_BITS:
        raise Error(f"bandwidth scale {scale} makes links faster than tc can shape (up to "
                    f"{format_bandwidth(MAX_SHAPED_BITS / 8)}): give a smaller --scale")
    where, rate = min(links, key=lambda link: link[1])
    if shaped_bits(rate, mtu) < MIN_SHAPED_BITS:
        scaled = f" (bandwidth scale {scale:g})" if scale != 1 else ""
        raise Error(f"link {where} would run at {format_bandwidth(rate)}{scaled}, below the 8 kbit/s "
                    "tc can shape: give it more bandwidth or a larger --scale")


def shaped_bits(rate, mtu):
    """The tbf rate (bit/s) that delivers ``rate`` bytes/s of TCP goodput over frames of ``mtu`` bytes."""
    return int(round(rate / goodput(mtu) * 8))


def _check_ranks_have_hosts(topo):
    for i in range(len(topo.ranks)):
        if topo.host_of(i) is None:
            raise Error(f"rank {i} ({topo.ranks[i]}) belongs to no host node; emulation runs every "
                        "rank inside a host: link it to a node of kind 'host' or give it a host attribute")


def _named_owner(topo, v, hosts):
    """The host a vertex names: its ``host`` attribute, else its id prefix before '/' if that is a host."""
    attr = topo.graph.nodes[v].get("host") if v in topo.graph else None
    if attr in hosts:
        return attr
    prefix = str(v).split("/", 1)[0]
    return prefix if prefix != v and prefix in hosts else None


def ownership(topo, hosts):
    """``{vertex: host}`` for every vertex inside some host (hosts map to themselves)."""
    host_set = set(hosts)
    owner = {h: h for h in hosts}
    for v in topo.nodes:
        named = _named_owner(topo, v, host_set)
        if named is not None:
            owner[v] = named
    for i in range(len(topo.ranks)):
        owner.setdefault(topo.ranks[i], topo.host_of(i))
    # Un-named devices (cpu, nic, ...) hanging off a host's vertices belong to that host.
    g = topo.graph
    todo = list(owner)
    while todo:
        v = todo.pop()
        for w in set(g.successors(v)) | set(g.predecessors(v)):
            if w not in owner and topo.kind(w) not in NAMED_KINDS:
                owner[w] = owner[v]
                todo.append(w)
    return owner


def _neighbours(graph, v):
    return set(graph.successors(v)) | set(graph.predecessors(v))


def _attachment(topo, host, owner, network_switches):
    """(switch, rate host->switch, rate switch->host) for one host; (None, 0, 0) for a lone host."""
    g = topo.graph
    own = {v for v, h in owner.items() if h == host}
    touched = {w for v in own for w in _neighbours(g, v)} - own
    others = sorted({owner[w] for w in touched if w in owner})
    if others:
        raise Error(f"host {host!r} is linked to host {others[0]!r} without a switch; the emulator joins "
                    "hosts only through switches: put a node of kind 'switch' between them")
    switches = sorted(w for w in touched if w in network_switches)
    if len(switches) > 1:
        raise Error(f"host {host!r} reaches {len(switches)} switches ({', '.join(switches)}); the "
                    "emulator gives each host one NIC on one switch")
    if not switches:
        return None, 0.0, 0.0
    sw = switches[0]
    sources = [topo.ranks[i] for i in topo.hosts.get(host, ())] or [host]
    out_rate, in_rate = _max_flow(g, own, sources, sw)
    if out_rate <= 0 or in_rate <= 0:
        raise Error(f"host {host!r} has no bandwidth {'to' if out_rate <= 0 else 'from'} switch {sw!r} "
                    "through its own devices; TCP needs both directions")
    return sw, out_rate, in_rate


def _max_flow(graph, own, sources, switch):
    """Max-flow (bytes/s) from the host's ranks to ``switch`` and back, within the host's own vertices."""
    sub = nx.DiGraph(graph.subgraph(own | {switch}))
    hub = ("ddl-emulate", "ranks")            # a vertex no topology can name
    for v in sources:
        sub.add_edge(hub, v)                   # no capacity attribute: infinite
        sub.add_edge(v, hub)
    out_rate = nx.maximum_flow_value(sub, hub, switch, capacity="capacity")
    in_rate = nx.maximum_flow_value(sub, switch, hub, capacity="capacity")
    return float(out_rate), float(in_rate)


def _check_connected(topo, hosts, switches, attach):
    lone = [h for h in hosts if attach[h][0] is None]
    if lone and len(hosts) > 1:
        raise Error(f"host {lone[0]!r} is not linked to any switch, so the other hosts cannot reach it")
    net = nx.Graph()
    net.add_nodes_from(switches)
    net.add_edges_from((a, b) for a, b in topo.graph.edges
                       if a != b and topo.kind(a) == "switch" and topo.kind(b) == "switch")
    if net.number_of_nodes() and not nx.is_forest(net):
        raise Error(f"the switches of {topo.name!r} form a loop ({_cycle_text(net)}); bridges without "
                    "spanning tree would flood it: emulate a tree of switches")
    used = {attach[h][0] for h in hosts} - {None}
    components = [c for c in nx.connected_components(net) if c & used]
    if len(components) > 1:
        raise Error(f"the switches of {topo.name!r} form {len(components)} separate networks; "
                    "link them so every host can reach every other")


def _cycle_text(graph):
    return " - ".join(str(a) for a, _ in nx.find_cycle(graph))


def _uplinks(topo, switches):
    """One veth pair per adjacent pair of switches, shaped each way to the summed link capacity."""
    g = topo.graph
    pairs = [(a, b) for i, a in enumerate(switches) for b in switches[i + 1:]
             if g.has_edge(a, b) or g.has_edge(b, a)]
    for n, (a, b) in enumerate(pairs):
        rate_ab, rate_ba = topo_capacity(g, a, b), topo_capacity(g, b, a)
        if rate_ab <= 0 or rate_ba <= 0:
            raise Error(f"switch link {a!r} - {b!r} carries traffic one way only; TCP needs both")
        yield UplinkPlan(a=a, b=b, end_a=f"u{n}a", end_b=f"u{n}b", rate_ab=rate_ab, rate_ba=rate_ba)


def topo_capacity(graph, u, v):
    return float(graph.edges[u, v].get("capacity", 0.0)) if graph.has_edge(u, v) else 0.0


# ----------------------------------------------------------------------------------------------------
# Preconditions
# ----------------------------------------------------------------------------------------------------

REQUIRED_TOOLS = ("ip", "tc", "unshare", "nsenter", "umount")
TEARDOWN_TOOLS = ("ip", "umount")      # what taking a cluster down uses


def check_can_emulate(tools=REQUIRED_TOOLS):
    """Raise :class:`ddl.Error` saying what is missing when this process cannot build namespaces."""
    if os.geteuid() != 0:
        raise Error("emulation needs root (it creates network namespaces, veths and tc qdiscs); "
                    "run it with sudo or as root")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise Error(f"emulation needs {', '.join(missing)} on PATH (packages iproute2, util-linux)")


def new_tag():
    """A namespace prefix no live namespace uses: ``ddl-<pid>``, suffixed if a stale one exists."""
    existing = set(list_namespaces())
    base, k = f"ddl-{os.getpid()}", 0
    tag = base
    while any(ns.startswith(tag + "-") for ns in existing):
        k += 1
        tag = f"{base}x{k}"
    return tag


def recorded_plan(state_dir):
    """The :class:`NetworkPlan` a cluster recorded in ``state_dir`` (FileNotFoundError: none is)."""
    return NetworkPlan.from_dict(json.loads((Path(state_dir) / "state.json").read_text())["plan"])


def list_namespaces():
    """Names of the network namespaces ``ip netns`` knows."""
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------
# The cluster: executing a plan
# ----------------------------------------------------------------------------------------------------

def state_dir_for(name):
    """Directory where cluster ``name`` records itself: the name made one safe path component, plus a
    short hash of the real name, since sanitising alone maps ``a b`` and ``a_b`` to one folder (and
    ``down`` of one would then take the other down)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).strip(".")[:64] or "cluster"
    digest = hashlib.sha256(str(name).encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return STATE_ROOT / f"{safe}-{digest}"


class Cluster:
    """A built (or being built) emulated cluster; a context manager that always tears down.

    ``Cluster.create(topo)`` plans and builds; ``Cluster.load(name)`` finds one built earlier (e.g. by
    ``ddl emulate up``) from its state file. ``down()`` is idempotent and tolerates half-built clusters.
    A cluster that ``create(..., reuse=True)`` found already up is *borrowed*: leaving the ``with``
    block lets go of its lock and leaves it up for whoever built it.
    """

    def __init__(self, plan, state_dir, lock=None, borrowed=False):
        self.plan = plan
        self.state_dir = Path(state_dir)
        self._lock = lock           # open file descriptor of the held state lock (see lock_state)
        self.borrowed = borrowed

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def create(cls, topo, state_dir=None, scale=1.0, mtu=MTU, reuse=False):
        """Plan (refusing topologies it cannot emulate before touching the system), then build.

        With ``reuse``, a cluster of the same name that is already up (``ddl emulate up``) is borrowed
        instead, if its links are the ones ``topo``, ``scale`` and ``mtu`` ask for; without, it is
        refused. Either way the caller holds the cluster's lock, so nobody takes it down meanwhile."""
        plan_network(topo, "ddl", scale, mtu)
        check_can_emulate()
        state_dir = Path(state_dir) if state_dir else state_dir_for(topo.name)
        lock = lock_state(state_dir, topo.name)
        try:
            old = live_cluster(state_dir)
            if old is not None and reuse:
                _check_same_links(old.plan, topo, scale, mtu)
                _check_idle(old.plan)
                return cls(old.plan, state_dir, lock, borrowed=True)
            if old is not None:
                raise Error(f"an emulated cluster {topo.name!r} is already up ({old.plan.tag}"
                            f"{_builder_state(old.plan.tag)}); `ddl emulate run` and `ddl bench --emulate` "
                            f"use it as it is, or take it down first with `ddl emulate down {topo.name}`")
            cluster = cls(plan_network(topo, new_tag(), scale, mtu), state_dir, lock)
        except BaseException:
            _release(state_dir, lock)
            raise
        try:
            cluster._save()
            cluster._build()
        except BaseException:
            cluster.down()
            raise
        return cluster

    @classmethod
    def load(cls, state_dir):
        try:
            return cls(recorded_plan(state_dir), state_dir)
        except FileNotFoundError:
            raise Error(f"no emulated cluster recorded in {state_dir} (is it up?)") from None

    def _save(self):
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "uts").mkdir(exist_ok=True)
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps({"plan": self.plan.to_dict(), "pid": os.getpid()}, indent=1))
        tmp.replace(self.state_dir / "state.json")

    def _build(self):
        p = self.plan
        if p.bridges:
            self._add_switch_namespace()
        for h in p.hosts:
            self._add_host(h)
        for u in p.uplinks:
            self._add_uplink(u)

    def _add_switch_namespace(self):
        ns = self.plan.switch_netns
        _sh(["ip", "netns", "add", ns])
        _ip(ns, "link", "set", "lo", "up")
        for br in self.plan.bridges.values():
            _ip(ns, "link", "add", br, "type", "bridge", "stp_state", "0", "forward_delay", "0")
            _ip(ns, "link", "set", br, "up")

    def _add_host(self, h):
        _sh(["ip", "netns", "add", h.netns])
        self._add_uts(h)
        _ip(h.netns, "link", "set", "lo", "up")
        if h.switch is None:
            # A lone host still gets an eth0 so MPI's TCP transport has its usual interface; a veth
            # whose peer stays in the namespace (kernels without the dummy driver have veth).
            _ip(h.netns, "link", "add", "eth0", "type", "veth", "peer", "name", "stub0")
            _ip(h.netns, "link", "set", "stub0", "up")
        else:
            sw = self.plan.switch_netns
            _ip(sw, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            mtu = self.plan.mtu
            _ip(sw, "link", "set", h.port, "mtu", str(mtu))
            _ip(h.netns, "link", "set", "eth0", "mtu", str(mtu))
            _ip(sw, "link", "set", h.port, "master", self.plan.bridges[h.switch])
            _shape(sw, h.port, h.rate_in, mtu)
            _shape(h.netns, "eth0", h.rate_out, mtu)
            _ip(sw, "link", "set", h.port, "up")
        _ip(h.netns, "addr", "add", f"{h.address}/{ADDRESS_PREFIX_LEN}", "dev", "eth0")
        _ip(h.netns, "link", "set", "eth0", "up")

    def _add_uts(self, h):
        """A persistent UTS namespace bound to a file, so every process of the host sees its hostname."""
        path = self.uts_file(h)
        path.touch()
        _sh(["unshare", f"--uts={path}", "hostname", h.hostname])

    def _add_uplink(self, u):
        ns = self.plan.switch_netns
        _ip(ns, "link", "add", u.end_a, "type", "veth", "peer", "name", u.end_b)
        for end, switch, rate in ((u.end_a, u.a, u.rate_ab), (u.end_b, u.b, u.rate_ba)):
            _ip(ns, "link", "set", end, "mtu", str(self.plan.mtu))
            _ip(ns, "link", "set", end, "master", self.plan.bridges[switch])
            _shape(ns, end, rate, self.plan.mtu)
            _ip(ns, "link", "set", end, "up")

    # -- use --------------------------------------------------------------------------------------
    def uts_file(self, h):
        return self.state_dir / "uts" / h.hostname

    def host_argv(self, host_id, argv):
        """argv that runs ``argv`` on an emulated host (its network and UTS namespaces)."""
        h = self.plan.host(host_id)
        return ["ip", "netns", "exec", h.netns, "nsenter", f"--uts={self.uts_file(h)}", "--", *argv]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.borrowed:
            self.release()
        else:
            self.down()
        return False

    def end_leftovers(self):
        """End whatever still runs in the cluster's hosts after a job (a launcher killed before its
        agents leaves them orphaned there); return their PIDs. The caller holds the cluster's lock
        and its job has ended, so they are that job's."""
        running = _host_pids(self.plan)
        for ns in running:
            _end_processes(ns)
        return sorted(pid for pids in running.values() for pid in pids)

    def release(self):
        """Let go of the cluster's lock and leave it up (for a borrowed one: as its builder left it)."""
        if self._lock is not None:
            _release(self.state_dir, self._lock)
            self._lock = None

    # -- teardown ---------------------------------------------------------------------------------
    def down(self):
        """End the processes inside the cluster's namespaces, delete them, unmount UTS files, forget state.

        Every namespace carries the cluster's unique tag, so every process inside one was started by
        this cluster's user through it: those are the only processes ended here, by PID. Refuses (Error)
        while another process holds the cluster's lock: it is building or running it, and tears it down.
        """
        with _signals_deferred():
            if self._lock is None:
                self._lock = lock_state(self.state_dir, self.plan.name)
            self._down()

    def _down(self):
        live = set(list_namespaces())
        for ns in self.plan.namespaces:
            if ns in live:
                _end_processes(ns)
        for ns in self.plan.namespaces:
            if ns in live:
                _sh(["ip", "netns", "del", ns], check=False)
        for h in self.plan.hosts:
            path = self.uts_file(h)
            if path.exists():
                _sh(["umount", str(path)], check=False)
        self._forget()
        left = [ns for ns in self.plan.namespaces if ns in set(list_namespaces())]
        if left:
            raise Error(f"could not delete namespaces {', '.join(left)}; remove them with `ip netns del`")

    def _forget(self):
        """Remove the state folder. Its lock file goes (and the lock is let go) only if this process
        holds the lock: the file must outlive anyone who may still lock it."""
        if self._lock is None:
            for path in self.state_dir.glob("*"):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.name != LOCK_FILE:
                    path.unlink(missing_ok=True)
            return
        shutil.rmtree(self.state_dir, ignore_errors=True)
        os.close(self._lock)
        self._lock = None


LOCK_FILE = "lock"


def lock_state(state_dir, name):
    """Take the exclusive lock of a cluster's state folder (an flock on its ``lock`` file, which the
    kernel lets go when this process ends, however it ends); return its file descriptor.

    Whoever builds, runs or removes a cluster holds it, so a second ``up`` or ``run`` of one file is
    refused here instead of finding a half-written record, calling it stale and tearing down the
    namespaces the first is still creating.
    """
    state_dir = Path(state_dir)
    path = state_dir / LOCK_FILE
    while True:
        state_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:       # the folder was just removed by the holder: try again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise Error(f"emulated cluster {name!r} is being built, run or removed by another process"
                        f"{f' (pid {holder})' if holder.isdigit() else ''}: wait for it to finish, or "
                        "end it (a build, or a run of a cluster it built, then tears that cluster down)") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)                    # locked a file its holder removed on the way out: lock the new one


def _release(state_dir, fd):
    """Let go of the state lock; a folder that holds only the lock file (nothing was built) goes too."""
    try:
        if [p.name for p in Path(state_dir).iterdir()] == [LOCK_FILE]:
            shutil.rmtree(state_dir, ignore_errors=True)
    finally:
        os.close(fd)


def _builder_state(tag):
    """What became of the process that built a cluster (its tag is ``ddl-<pid>``), when it has ended:
    the cluster was then left up by ``ddl emulate up``, or by a run that was killed."""
    pid = tag.split("-", 1)[1].split("x", 1)[0] if tag.startswith("ddl-") else ""
    if not pid.isdigit() or Path(f"/proc/{pid}").exists():
        return ""
    return f", left up by process {pid}, no longer running: `ddl emulate up`, or a run that was killed"


def live_cluster(state_dir):
    """The cluster recorded in ``state_dir`` if its namespaces are up, else None, after cleaning a
    stale record whose namespaces died (a reboot, or someone's `ip netns del`).

    The caller holds the state lock, so the stale record's teardown leaves the lock file in place.
    """
    if not (Path(state_dir) / "state.json").exists():
        return None
    old = Cluster.load(state_dir)
    live = set(list_namespaces())
    if set(old.plan.namespaces) <= live:
        return old
    if set(old.plan.namespaces) & live:
        raise Error(f"emulated cluster {old.plan.name!r} ({old.plan.tag}) is up in part only (namespaces "
                    f"{', '.join(sorted(set(old.plan.namespaces) - live))} are gone); take it down with "
                    f"`ddl emulate down {old.plan.name}`")
    with _signals_deferred():
        old._down()
    return None


@dataclass(frozen=True)
class Recorded:
    """A cluster recorded under :data:`STATE_ROOT`, as ``ddl emulate list`` shows it."""
    folder: Path
    plan: NetworkPlan = None    # None: no readable record (being built this instant, or a damaged file)
    missing: tuple = ()         # its namespaces that no longer exist
    holder: int = None          # the process holding its lock: building it, running a job on it, removing it
    pids: tuple = ()            # processes running in its hosts

    @property
    def gone(self):
        """Nothing of it is up: a stale record (its namespaces were deleted, or the machine rebooted
        without clearing /run), which ``ddl emulate down`` removes."""
        return self.plan is not None and len(self.missing) == len(self.plan.namespaces)


def recorded_clusters():
    """Every cluster recorded under :data:`STATE_ROOT`, by name, with what is up of it, who holds it and
    what runs in its hosts. It only reads: no lock is taken (who holds one is read from /proc/locks), so
    a build, run or teardown going on meanwhile is not disturbed."""
    if not STATE_ROOT.is_dir():
        return []
    live = set(list_namespaces())
    holders = _flock_holders()
    found = []
    try:
        folders = sorted(p for p in STATE_ROOT.iterdir() if p.is_dir())
    except OSError as exc:
        raise Error(f"cannot read {STATE_ROOT}, where emulated clusters are recorded: {exc.strerror} "
                    f"(run as root)") from None
    for folder in folders:
        holder = _lock_holder(folder / LOCK_FILE, holders)
        try:
            plan = recorded_plan(folder)
        except FileNotFoundError:
            if holder is not None:       # (a folder with its lock file only holds nothing)
                found.append(Recorded(folder, holder=holder))
            continue
        except (OSError, ValueError, KeyError, TypeError):
            found.append(Recorded(folder, holder=holder))
            continue
        missing = tuple(ns for ns in plan.namespaces if ns not in live)
        running = _host_pids(plan, live)
        found.append(Recorded(folder, plan, missing, holder, tuple(sorted(p for ps in running.values() for p in ps))))
    return sorted(found, key=lambda r: (r.plan is None, r.plan.name if r.plan else r.folder.name))


def _flock_holders():
    """``{(device, inode): pid}`` of the files ``flock``-ed on this machine (/proc/locks; those waiting
    for a lock, listed after ``->``, are left out)."""
    holders = {}
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return holders
    for line in lines:
        words = line.split()
        if len(words) < 6 or words[1] != "FLOCK":
            continue
        try:
            major, minor, inode = words[5].split(":")
            holders[(os.makedev(int(major, 16), int(minor, 16)), int(inode))] = int(words[4])
        except ValueError:
            continue
    return holders


def _lock_holder(path, holders):
    """The PID holding ``path``'s flock (see :func:`lock_state`), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return holders.get((st.st_dev, st.st_ino))


def _check_idle(plan):
    """Refuse to run on a cluster in whose hosts processes still run: nobody holds its lock, so they
    are a job whose ``ddl emulate run`` was killed (or the user's own), and they would share the links
    with the new job."""
    pids = sorted(pid for found in _host_pids(plan).values() for pid in found)
    if pids:
        shown = ", ".join(map(str, pids[:8])) + (" ..." if len(pids) > 8 else "")
        raise Error(f"emulated cluster {plan.name!r} ({plan.tag}) is up with processes still running in its "
                    f"hosts (pids {shown}: a job whose `ddl emulate run` was killed?), which would share its "
                    f"links; end them, or take the cluster down with `ddl emulate down {plan.name}`")


def _check_same_links(plan, topo, scale, mtu):
    """Refuse to run on a cluster that is up with links other than those asked for: measurements would
    be of another network than the file (and the --scale) the caller believes it measures."""
    wanted = plan_network(topo, plan.tag, scale, mtu)
    if wanted.to_dict() == plan.to_dict():
        return
    if plan.mtu != wanted.mtu:
        why = f"--mtu {plan.mtu}, not the {wanted.mtu} asked for"
    elif (ratio := _uniform_ratio(plan, wanted)) is not None:
        why = f"--scale {ratio * scale:.6g}, not the {scale:g} asked for"
    else:
        why = "other hosts, switches, ranks or rates than the file has now"
    raise Error(f"emulated cluster {topo.name!r} is up, built with {why}; run with the options it was "
                f"built with, or take it down first with `ddl emulate down {topo.name}`")


def _uniform_ratio(built, wanted):
    """The one factor between the rates of two plans of the same network, or None if they differ
    otherwise."""
    def rates(p):
        return [r for h in p.hosts for r in (h.rate_out, h.rate_in)] + \
               [r for u in p.uplinks for r in (u.rate_ab, u.rate_ba)]

    def without_rates(p):
        return replace(p, hosts=tuple(replace(h, rate_out=0.0, rate_in=0.0) for h in p.hosts),
                       uplinks=tuple(replace(u, rate_ab=0.0, rate_ba=0.0) for u in p.uplinks))

    pairs = list(zip(rates(built), rates(wanted)))
    if without_rates(built) != without_rates(wanted) or not pairs or any(w <= 0 for _, w in pairs):
        return None
    ratios = [b / w for b, w in pairs]
    return ratios[0] if all(math.isclose(r, ratios[0], rel_tol=1e-9) for r in ratios) else None


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _signals_deferred:
    """Hold Ctrl-C, SIGTERM and SIGHUP while tearing down (any of them would leave half a cluster and its
    state folder behind); deliver the first of them after, to whatever handled it before.

    They are blocked as well as caught, so that the teardown's ``ip``, ``tc`` and ``umount`` start with
    them blocked: a Ctrl-C goes to the terminal's whole foreground process group, and one pressed again
    would otherwise kill ``ip netns pids`` (which then finds no process to end) or ``ip netns del``.
    If the teardown itself failed, only a signal whose default action ends the process is delivered:
    a handler's exception would hide the teardown's error. Signals handled outside Python (getsignal
    None) are left alone: there is no handler to give them back to.
    """

    def __enter__(self):
        self.hit = None
        self.saved = {}
        self.mask = None
        if threading.current_thread() is threading.main_thread():
            self.saved = {s: signal.signal(s, self._note) for s in DEFERRED_SIGNALS
                          if signal.getsignal(s) is not None}
            self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.saved)
        return self

    def _note(self, signum, frame):
        if self.hit is None:
            self.hit = signum

    def __exit__(self, *exc):
        if self.mask is not None and self.saved:
            while (info := signal.sigtimedwait(self.saved, 0)) is not None:    # take the held ones
                self._note(info.si_signo, None)
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
        for s, handler in self.saved.items():
            signal.signal(s, handler)
        if self.hit is not None and (exc[0] is None or self.saved[self.hit] == signal.SIG_DFL):
            signal.raise_signal(self.hit)
        return False


def _end_processes(ns, grace=2.0):
    """SIGTERM, then SIGKILL, the processes living in namespace ``ns`` (all started through it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _netns_pids(ns):
            time.sleep(0.05)


def _host_pids(plan, live=None):
    """``{namespace: PIDs}`` of the cluster's hosts that have processes running in them (``live``: the
    namespaces that exist, where some may be gone; only those are asked)."""
    running = {h.netns: _netns_pids(h.netns) for h in plan.hosts if live is None or h.netns in live}
    return {ns: pids for ns, pids in running.items() if pids}


def _netns_pids(ns):
    out = _sh(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _shape(ns, dev, rate, mtu):
    """tbf on the transmitting device: the one place a direction of a veth can be shaped exactly."""
    bits = shaped_bits(rate, mtu)          # within tc's range: plan_network refuses others
    burst = max(TBF_MIN_BURST, int(rate * TBF_BURST_SECONDS))
    _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
         "burst", str(burst), "latency", TBF_LATENCY])


def _ip(ns, *args):
    return _sh(["ip", "-n", ns, *args])


def _sh(argv, check=True):
    """Run one short administrative command; failures become :class:`ddl.Error` with its stderr."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except FileNotFoundError:
        raise Error(f"{argv[0]} not found: emulation needs iproute2 and util-linux") from None
    except subprocess.TimeoutExpired:
        raise Error(f"`{' '.join(argv)}` did not finish in {COMMAND_TIMEOUT:.0f} s") from None
    if check and res.returncode != 0:
        raise Error(f"`{' '.join(argv)}` failed: {res.stderr.strip() or res.returncode}")
    return res

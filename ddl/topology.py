"""The cluster model every other part of ddl plans against: vertices, links, ranks, routes, tiers.

A :class:`Topology` is immutable and identified by its fingerprint (sha256 of its canonical explicit
form), so plans and measurements can be cached per topology. Two files that list the same nodes,
links and ranks in the same order compare equal however they spell units or use ``for:``/``tiers:``;
listing them in another order, writing a link ``b`` to ``a``, or as ``count: 2`` of half the bandwidth
gives another fingerprint (plans are then made and cached once more, never shared wrongly).
Reading and validating files is :mod:`ddl.topology_file`; this module adds what needs the graph:
reachability between ranks, routes, hosts and tiers.

Units: bytes/s, seconds.
"""
import bisect
import functools
import hashlib
import itertools
import json
import math
import operator
from collections import namedtuple

import networkx as nx
from networkx.utils import UnionFind

from . import topology_file
from .errors import Error, TopologyError
from .settings import named_by_env
from .topology_file import Link

__all__ = ["Topology", "Link", "Tier"]

Tier = namedtuple("Tier", "bandwidth groups")
Tier.__doc__ = """One level of the rank hierarchy: ``groups`` (tuples of rank indices) that are joined by
paths whose every link carries at least ``bandwidth`` bytes/s."""

TRANSIT_KINDS = frozenset({"switch", "nic", "host", "cpu", "pcie"})
DEFAULT_REDUCE_BANDWIDTH = {"gpu": 1000e9}  # bytes/s by kind
OTHER_REDUCE_BANDWIDTH = 5e9

# In the level graphs used for routing, a rank vertex is split in two copies: one that only sends
# (the route's source) and one that only receives (its destination). No path can then pass *through*
# a rank, which is the "ranks never forward" rule, without filtering per query.
_SEND, _RECV = "send", "recv"


class Topology:
    """An immutable cluster topology: a bandwidth graph plus the vertices the ranks run on.

    Construct it with :meth:`load` (YAML/JSON file), :meth:`from_dict` or directly with
    ``Topology(name, nodes, links, ranks, defaults=None, source=None)``; all three validate and raise
    :class:`~ddl.errors.TopologyError` on bad input.
    """

    def __init__(self, name, nodes, links, ranks, defaults=None, source=None, description=None):
        self._setup(topology_file.build(name, nodes, links, ranks, defaults, source, description))

    @classmethod
    def load(cls, path):
        """Read a topology file (YAML, or JSON for ``*.json``)."""
        try:
            return cls._from_spec(topology_file.load(path))
        except Error as exc:
            note = named_by_env(path)
            if note and exc.args and isinstance(exc.args[0], str):
                exc.args = (f"{exc.args[0]} [the file {note}]",) + exc.args[1:]
            raise

    @classmethod
    def from_dict(cls, data, source=None):
        """Build from plain data in any file form (explicit, ``for:``, ``tiers:``).

        ``source`` names the origin in error messages (``<dict>`` when None)."""
        return cls._from_spec(topology_file.parse(data, source))

    @classmethod
    def _from_spec(cls, spec):
        topo = cls.__new__(cls)
        topo._setup(spec)
        return topo

    def _setup(self, spec):
        self._spec = spec
        self._kinds = {node_id: kind for node_id, kind, _ in spec.nodes}
        self._attrs = {node_id: attrs for node_id, _, attrs in spec.nodes}
        self._rank_of = {vertex: i for i, vertex in enumerate(spec.ranks)}
        self._graph = nx.freeze(self._build_graph())
        usable = [v for v in self._graph if v in self._rank_of or self.is_transit(v)]
        self._usable = nx.freeze(self._graph.subgraph(usable).copy())
        self._levels = sorted({c for _, _, c in self._usable.edges(data="capacity")}, reverse=True)
        self._level_graphs = {}
        self._routes = {}
        self._check_ranks_reach_each_other()

    def _build_graph(self):
        graph = nx.DiGraph()
        for node_id, kind, attrs in self._spec.nodes:
            graph.add_node(node_id, kind=kind, **attrs)
        for link in self._spec.links:
            directions = [(link.a, link.b)] if link.directed else [(link.a, link.b), (link.b, link.a)]
            for u, v in directions:
                capacity = link.bandwidth * link.count
                if graph.has_edge(u, v):
                    edge = graph[u][v]
                    edge["capacity"] += capacity
                    edge["latency"] = min(edge["latency"], link.latency)
                else:
                    graph.add_edge(u, v, capacity=capacity, latency=link.latency)
        return graph

    # ------------------------------------------------------------------------------ plain accessors

    name = property(lambda self: self._spec.name, doc="The topology's name.")
    description = property(lambda self: self._spec.description, doc="Free text from the file, or None.")
    source = property(lambda self: self._spec.source, doc="The file it was loaded from, or None.")
    ranks = property(lambda self: self._spec.ranks, doc="Vertex id of each rank (tuple).")
    nranks = property(lambda self: len(self._spec.ranks), doc="Number of ranks.")
    links = property(lambda self: self._spec.links, doc="Normalized links (tuple of Link), file order.")
    graph = property(lambda self: self._graph, doc="Frozen DiGraph of every vertex and link direction; "
                                                   "edge attrs capacity (bytes/s) and latency (s).")

    @property
    def nodes(self):
        """Node ids in file order."""
        return tuple(node_id for node_id, _, _ in self._spec.nodes)

    def kind(self, v):
        """Kind of vertex ``v`` (``gpu``, ``switch``, ...)."""
        return self._kinds[v]

    def is_transit(self, v):
        """True when routes may pass through ``v``: a switch/nic/host/cpu/pcie vertex that is no rank.

        GPUs never forward (a GPU outside the job cannot relay data) and neither do ranks."""
        return self._kinds[v] in TRANSIT_KINDS and v not in self._rank_of

    def usable_graph(self):
        """Frozen DiGraph of the vertices that can carry collective traffic: ranks and transit vertices."""
        return self._usable

    def capacity(self, u, v):
        """Capacity of the edge u -> v in bytes/s (parallel links summed), 0.0 when there is none."""
        edge = self._graph.get_edge_data(u, v)
        return float(edge["capacity"]) if edge else 0.0

    def latency(self, u, v):
        """Latency of the edge u -> v in seconds (fastest parallel link), inf when there is none."""
        edge = self._graph.get_edge_data(u, v)
        return edge["latency"] if edge else math.inf

    def reduce_bandwidth(self, i):
        """Bytes/s at which rank ``i`` combines data: the node's ``reduce_bandwidth``, else the file's
        ``defaults.reduce_bandwidth``, else 1000 GB/s for a GPU and 5 GB/s for anything else."""
        vertex = self._spec.ranks[i]
        value = self._attrs[vertex].get("reduce_bandwidth", self._spec.defaults.get("reduce_bandwidth"))
        if value is None:
            value = DEFAULT_REDUCE_BANDWIDTH.get(self._kinds[vertex], OTHER_REDUCE_BANDWIDTH)
        return value

    @property
    def message_cost(self):
        """Seconds a rank spends to start each message it sends (``defaults.message_cost``; 0 when the
        file gives none): the software cost of a send that no link accounts for. A rank starts its
        messages one at a time, so a schedule of many small messages pays it where bytes are few."""
        return self._spec.defaults.get("message_cost", 0.0)

    # ----------------------------------------------------------------------------------------- routes

    def routes(self, i, j):
        """Paths (tuples of vertex ids) from rank ``i`` to rank ``j`` that data should take.

        Ranks joined by a direct link use that link alone: peer-to-peer transports take it and no other
        path (a CUDA peer copy between GPUs joined by NVLink never goes through their PCIe switch).
        Otherwise the widest paths (largest bottleneck capacity) and among those the fewest hops; every
        tied path (ECMP), sorted. Intermediate vertices are transit vertices only. ``i == j`` gives the
        one-vertex path. Cached per pair."""
        return self._route_entry(i, j)[0]

    def route_bandwidth(self, i, j):
        """Bottleneck capacity (bytes/s) of :meth:`routes`; inf for ``i == j``."""
        return self._route_entry(i, j)[1]

    def route_latency(self, i, j):
        """Sum of the link latencies along the first of :meth:`routes` (seconds)."""
        path = self.routes(i, j)[0]
        return sum(self._graph[u][v]["latency"] for u, v in itertools.pairwise(path))

    def _route_entry(self, i, j):
        key = (self._rank_index(i), self._rank_index(j))
        if key not in self._routes:
            self._routes[key] = self._compute_routes(*key)
        return self._routes[key]

    def _rank_index(self, i):
        """``i`` as a plain int (numpy integers welcome), or IndexError."""
        index = None if isinstance(i, bool) else _as_index(i)
        if index is None or not 0 <= index < self.nranks:
            raise IndexError(f"rank {i!r} out of range: this topology has ranks 0..{self.nranks - 1}")
        return index

    def _compute_routes(self, i, j):
        if i == j:
            return ((self._spec.ranks[i],),), math.inf
        a, b = self._spec.ranks[i], self._spec.ranks[j]
        if self._usable.has_edge(a, b):
            return ((a, b),), self._usable[a][b]["capacity"]
        source, target = (self._spec.ranks[i], _SEND), (self._spec.ranks[j], _RECV)
        level = bisect.bisect_left(range(len(self._levels)), True,
                                   key=lambda k: self._reachable(k, source, target))
        routes = tuple(sorted(tuple(_vertex(x) for x in path)
                              for path in self._shortest_paths(level, source, target)))
        return routes, self._levels[level]

    def _shortest_paths(self, level, source, target):
        """All fewest-hop paths in a level graph, meeting in the middle: a BFS of half the distance
        from each end stays small (a GPU's host and rack) where one BFS over the whole distance would
        visit most of a large cluster for every pair."""
        forward, backward = self._level_graph(level), self._level_graph(level, reverse=True)
        hops = nx.shortest_path_length(forward, source, target)
        near = (hops + 1) // 2
        from_source, seen_source = _bfs(forward, source, near)
        from_target, seen_target = _bfs(backward, target, hops - near)
        for middle, depth in seen_source.items():
            if depth == near and seen_target.get(middle) == hops - near:
                for head in _paths_back(from_source, source, middle):
                    for tail in _paths_back(from_target, target, middle):
                        yield head + tail[-2::-1]

    def _reachable(self, level, source, target):
        graph = self._level_graph(level)
        return source in graph and target in graph and nx.has_path(graph, source, target)

    def _level_graph(self, level, reverse=False):
        """Usable edges with capacity >= the level's bandwidth, ranks split into send/recv copies
        (or the same graph reversed)."""
        if level not in self._level_graphs:
            floor = self._levels[level]
            edges = [(self._as(u, _SEND), self._as(v, _RECV))
                     for u, v, c in self._usable.edges(data="capacity") if c >= floor]
            self._level_graphs[level] = (nx.DiGraph(edges), nx.DiGraph((v, u) for u, v in edges))
        return self._level_graphs[level][reverse]

    def _as(self, v, role):
        return (v, role) if v in self._rank_of else v

    def _check_ranks_reach_each_other(self):
        """Raise TopologyError naming one pair of ranks without a path (in either direction).

        Fast path: some strongly connected set of transit vertices that every rank both sends to and
        receives from directly connects all pairs. Otherwise search from every rank."""
        if self._transit_hub_connects_all():
            return
        graph = self._level_graph(len(self._levels) - 1) if self._levels else nx.DiGraph()
        ranks = self._spec.ranks
        for i, s in enumerate(ranks):
            reached = nx.descendants(graph, (s, _SEND)) if (s, _SEND) in graph else set()
            for j, t in enumerate(ranks):
                if i != j and (t, _RECV) not in reached:
                    raise TopologyError(
                        f"rank {i} ({s}) cannot reach rank {j} ({t}): no path through switch, nic, "
                        f"host, cpu or pcie vertices (GPUs and other ranks never forward data); add a "
                        f"link or connect both to a switch, or remove one of them from ranks",
                        source=self.source or "<dict>", entry="ranks")

    def _transit_hub_connects_all(self):
        transit = [v for v in self._usable if v not in self._rank_of]
        component = {}
        for c, members in enumerate(nx.strongly_connected_components(self._usable.subgraph(transit))):
            component.update(dict.fromkeys(members, c))
        common = None
        for vertex in self._spec.ranks:
            sends = {component[v] for v in self._usable.successors(vertex) if v in component}
            receives = {component[v] for v in self._usable.predecessors(vertex) if v in component}
            common = (sends & receives) if common is None else common & sends & receives
            if not common:
                return False
        return True

    # ----------------------------------------------------------------------------------- hosts, tiers

    @functools.cached_property
    def _host_of(self):
        return tuple(self._find_host(v) for v in self._spec.ranks)

    def _find_host(self, vertex, linked=True):
        """The node's ``host`` attribute, else the id prefix before '/' when it names a host node,
        else the vertex itself when it is a host, else (``linked``) the host node it links to directly."""
        if "host" in self._attrs[vertex]:
            return self._attrs[vertex]["host"]
        prefix = vertex.split("/", 1)[0]
        if prefix != vertex and self._kinds.get(prefix) == "host":
            return prefix
        if self._kinds[vertex] == "host":
            return vertex
        if not linked:
            return None
        neighbours = set(self._graph.successors(vertex)) | set(self._graph.predecessors(vertex))
        hosts = sorted((v for v in neighbours if self._kinds[v] == "host"), key=self._node_order.get)
        return hosts[0] if hosts else None

    @functools.cached_property
    def _node_order(self):
        """Position of every node in the file (built once: a rank's host is looked up per rank)."""
        return {v: k for k, v in enumerate(self._kinds)}

    def host_of(self, i):
        """Host id of rank ``i``, or None when it has none."""
        return self._host_of[i]

    @property
    def hosts(self):
        """``{host_id: (rank indices on it, ascending)}`` for every host that carries a rank."""
        out = {}
        for i, host in enumerate(self._host_of):
            if host is not None:
                out.setdefault(host, []).append(i)
        return {host: tuple(members) for host, members in out.items()}

    @functools.cached_property
    def host_bandwidths(self):
        """``{host_id: bytes/s}`` for every host of :attr:`hosts`: what the usable links between the
        host's vertices and the rest of the fabric carry, in the weaker direction (out or in), so a host
        behind one 25 Gbit/s NIC has 3.125 GB/s however fast it is inside. A host's vertices are those
        that name it (``host`` attribute, id prefix, the host itself), its ranks, and other non-switch
        vertices linked to it directly (its NICs); a switch between hosts belongs to none."""
        where = {v: self._find_host(v, linked=self._kinds[v] != "switch") for v in self._usable}
        out, into = dict.fromkeys(self.hosts, 0.0), dict.fromkeys(self.hosts, 0.0)
        for u, v, capacity in self._usable.edges(data="capacity"):
            a, b = where[u], where[v]
            if a != b:
                if a in out:
                    out[a] += capacity
                if b in into:
                    into[b] += capacity
        return {h: min(out[h], into[h]) for h in out}

    @functools.cached_property
    def tiers(self):
        """The rank hierarchy, fastest tier first, by single-linkage clustering on link bandwidth.

        Two ranks belong to the same group of the tier with bandwidth B when the usable graph joins
        them by a chain of links each of capacity >= B (a link's weight is the smaller of its two
        directions, or its one direction when it has no reverse). Computed Kruskal-style: links in
        decreasing weight join union-find sets; a tier is recorded after each weight at which two sets
        holding ranks merged. So tier bandwidths strictly decrease, each tier's groups are unions of the
        previous tier's, and the last tier is one group of every rank. Groups are sorted by their
        smallest rank, ranks ascending within a group. A single rank gives one tier of bandwidth inf.

        This is a clustering (where the fast islands are), not a routing statement: the chain may pass
        through ranks, e.g. the 8 GPUs of a DGX-1 form one NVLink group although GPU 0 reaches GPU 6
        only over PCIe."""
        if self.nranks == 1:
            return (Tier(math.inf, ((0,),)),)
        sets = UnionFind(self._usable)
        members = {v: [i] for i, v in enumerate(self._spec.ranks)}  # set root -> its ranks
        tiers = []
        for weight, edges in itertools.groupby(self._undirected_edges(), key=lambda e: e[0]):
            merged = False
            for _, u, v in edges:
                merged |= _union(sets, members, u, v)
            if merged:
                tiers.append(Tier(weight, tuple(sorted(tuple(sorted(m)) for m in members.values()))))
                if len(members) == 1:
                    break
        return tuple(tiers)

    def _undirected_edges(self):
        """``(weight, u, v)`` once per linked pair, heaviest first."""
        edges = []
        for u, v, capacity in self._usable.edges(data="capacity"):
            reverse = self._usable.get_edge_data(v, u)
            if reverse is None:
                edges.append((capacity, u, v))
            elif u < v:
                edges.append((min(capacity, reverse["capacity"]), u, v))
        return sorted(edges, key=lambda e: -e[0])

    # ---------------------------------------------------------------------- identity, serialization

    def to_dict(self):
        """The explicit form (plain data, no ``for:``/``tiers:``) that :meth:`from_dict` loads back equal."""
        return topology_file.explicit(self._spec)

    def dump(self, path):
        """Write :meth:`to_dict` as YAML, or JSON when ``path`` ends in ``.json``."""
        topology_file.write(self.to_dict(), path)

    @functools.cached_property
    def fingerprint(self):
        """sha256 hex digest of the canonical JSON of :meth:`to_dict`."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def with_ranks(self, vertex_ids):
        """The same fabric with another rank list (validated like a file's ``ranks``)."""
        spec = self._spec
        nodes = [{"id": node_id, "kind": kind, **attrs} for node_id, kind, attrs in spec.nodes]
        return Topology(spec.name, nodes, spec.links, list(vertex_ids), spec.defaults, spec.source,
                        spec.description)

    def __eq__(self, other):
        if not isinstance(other, Topology):
            return NotImplemented
        return self.fingerprint == other.fingerprint

    def __hash__(self):
        return hash(self.fingerprint)

    def __reduce__(self):
        return _rebuild, (self.to_dict(), self.source)

    def __repr__(self):
        return (f"<Topology {self.name!r}: {self.nranks} ranks, {len(self._spec.nodes)} nodes, "
                f"{len(self._spec.links)} links, {self.fingerprint[:12]}>")


def _rebuild(data, source):
    return Topology.from_dict(data, source)


def _bfs(graph, root, depth):
    """BFS predecessor lists and depths of the vertices at most ``depth`` hops from ``root``."""
    if depth == 0:  # nx.predecessor reads cutoff=0 as "no cutoff"
        return {root: []}, {root: 0}
    return nx.predecessor(graph, root, cutoff=depth, return_seen=True)


def _paths_back(predecessors, source, vertex):
    """Every shortest path source -> vertex, from a BFS predecessor map (all branches reach source)."""
    if vertex == source:
        yield (vertex,)
        return
    for previous in predecessors[vertex]:
        for path in _paths_back(predecessors, source, previous):
            yield path + (vertex,)


def _as_index(i):
    try:
        return operator.index(i)
    except TypeError:
        return None


def _vertex(x):
    """Vertex id of a level-graph node (rank copies are ``(id, role)`` tuples)."""
    return x[0] if isinstance(x, tuple) else x


def _union(sets, members, u, v):
    """Join the sets of u and v; True when both held ranks (the rank partition got coarser)."""
    ru, rv = sets[u], sets[v]
    if ru == rv:
        return False
    sets.union(ru, rv)
    a, b = members.pop(ru, []), members.pop(rv, [])
    if len(a) < len(b):
        a, b = b, a
    a.extend(b)
    if a:
        members[sets[ru]] = a
    return bool(a) and bool(b)

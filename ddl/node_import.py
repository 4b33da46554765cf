"""What ``ddl topo import`` writes, whichever description of a machine it read.

One machine's vertices and links are written once, as ``for: {h: hosts}`` templates (on a single host,
written out for ``h0``); the hosts' NICs join one non-blocking switch ``fabric``; the GPUs are the
ranks, host-major. The file's header says where every figure came from: what the machine's own
description gave and what an option or a default assumed, so that whoever reads the file can tell a
measurement from a guess. The readers (:mod:`ddl.nvidia_smi`, :mod:`ddl.nccl_xml`) decide which
vertices and links the machine has.
"""
import textwrap

from .errors import TopologyError
from .topology_file import bandwidth_text
from .units import counted, format_bandwidth, parse_bandwidth

DEFAULT_CPU_LINK = 38.4e9       # two QPI links of 19.2 GB/s (Xeon E5 v4, as in dgx1-v100.yaml)
FABRIC_LATENCY = "2 us"         # one switch hop of InfiniBand class


class NodeWriter:
    """The vertices and links of one machine, repeated on ``hosts`` hosts; ``nvlink_domain`` hosts in a
    row share their NVSwitches (multi-node NVLink), 1 when every host has its own."""

    def __init__(self, hosts, nvlink_domain=1):
        self.hosts, self.nvlink_domain = hosts, nvlink_domain
        self.nodes, self.links, self.switches, self.cpus = [], [], [], []
        self.node("h{h}", "host")

    def node(self, vertex, kind):
        self.nodes.append(_per_host({"id": vertex, "kind": kind}, self.hosts))
        if kind == "cpu":
            self.cpus.append(vertex)
        return vertex

    def link(self, a, b, bandwidth, count=1):
        self.links.append(_per_host(_link_entry(a, b, bandwidth, count), self.hosts))

    def switch(self, above, rate):
        """A new PCIe switch linked to ``above`` at ``rate``."""
        vertex = self.node(f"h{{h}}/pcie{len(self.switches)}", "pcie")
        self.switches.append(vertex)
        self.link(vertex, above, rate)
        return vertex

    def nvswitch(self, gpus, rate, counts):
        """One vertex for the machine's NVSwitches, ``counts[g]`` links of ``rate`` from each GPU; with
        NVLink domains of several hosts, one vertex ``nvlink{d}`` for each domain's NVSwitches."""
        if self.nvlink_domain == 1:
            hub = self.node("h{h}/nvswitch", "switch")
            for g in gpus:
                self.link(g, hub, rate, count=counts[g])
            return
        self.nodes.append({"id": "nvlink{d}", "kind": "switch", "for": {"d": self.hosts // self.nvlink_domain}})
        domain_of = [[h, h // self.nvlink_domain] for h in range(self.hosts)]
        for g in gpus:
            entry = _link_entry(g.replace("{h}", "{p[0]}"), "nvlink{p[1]}", rate, counts[g])
            self.links.append({**entry, "for": {"p": domain_of}})

    def sockets(self, rate):
        """Every NUMA node's link to the others: one link between two, a switch among more."""
        if len(self.cpus) == 2:
            self.link(*self.cpus, rate)
        elif len(self.cpus) > 2:
            hub = self.node("h{h}/smp", "switch")
            for c in self.cpus:
                self.link(c, hub, rate)

    def counts(self):
        """The header's count of what the machine has beside GPUs and NICs."""
        return f"{counted(len(self.cpus), 'NUMA node')}, {counted(len(self.switches), 'PCIe switch', 'PCIe switches')}"

    def assumptions(self, cpu_link, nics, nic_option):
        """The header's words on what joins NUMA nodes, NICs and hosts; ``nics``: (vertex, rate) pairs,
        ``nic_option``: whether --nic-bandwidth set their rate."""
        words = []
        if len(self.cpus) > 1:
            words.append(f"each NUMA node to the others {format_bandwidth(cpu_link)} (--cpu-link)")
        if nics and nic_option:
            words.append(f"NICs {format_bandwidth(nics[0][1])} (--nic-bandwidth), each on its PCIe switch at that "
                         f"rate")
        if self.hosts > 1:
            words.append(f"{self.hosts} hosts on one non-blocking switch `fabric` ({FABRIC_LATENCY})")
        if self.nvlink_domain > 1:
            words.append(f"NVLink domains of {self.nvlink_domain} hosts (--nvlink-domain): the NVSwitches of a "
                         f"domain's hosts are one non-blocking switch `nvlink{{d}}`")
        return words

    def text(self, name, gpus, nics, header):
        """The whole file: ``gpus`` (indices) are the ranks; ``nics`` (vertex, rate) pairs join the
        hosts when there are several; ``header``: its lines, each a paragraph."""
        data = {"name": name, "defaults": {"latency": "1 us"}, "nodes": list(self.nodes), "links": list(self.links)}
        if self.hosts > 1:
            data["nodes"].append({"id": "fabric", "kind": "switch"})
            data["links"].extend(_per_host({"a": vertex, "b": "fabric", "bandwidth": bandwidth_text(rate),
                                            "latency": FABRIC_LATENCY}, self.hosts) for vertex, rate in nics)
        data["ranks"] = [_per_host({"id": "h{h}/gpu{g}"}, self.hosts, g=list(gpus))]
        return "".join(textwrap.fill(line, 100, initial_indent="# ", subsequent_indent="#   ") + "\n"
                       for line in header) + _yaml(data)


def header(source, what, found, read, assumed):
    """The header's lines: what made the file from which ``source`` (a ``what``), what the machine
    has (``found``), what its description said (``read``) and what was assumed (a list)."""
    return [f"Made by `ddl topo import` from {source} ({what}): {found}.",
            f"From the {read}.",
            "Assumed (edit here, or import again with other options): " + "; ".join(assumed) + ".",
            "Simplified: PCIe switches are non-blocking; GPUs never forward (routes between GPUs without "
            "an NVLink go over PCIe and the CPUs).",
            "The host nodes h0, h1, ... only group the ranks (ids h0/...)."]


def pick(items, wanted, by_name, what, option, source, listed):
    """The items that ``wanted`` names (keys of ``by_name``), in their order; all when None."""
    if wanted is None:
        return list(items)
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise TopologyError(f"{option}: the machine has no {what} {', '.join(map(str, unknown))}; it has "
                            f"{', '.join(listed) or 'none'}", source)
    chosen = {by_name[w] for w in wanted}
    return [d for d in items if d in chosen]


def check_nvlink_domain(hosts, domain, switched, source):
    """``domain`` hosts (None: not given) share NVSwitches: whole domains, on a machine that has some."""
    if domain is None or domain == 1:
        return
    if hosts % domain:
        raise TopologyError(f"--nvlink-domain {domain} must divide --hosts {hosts}: the job takes whole NVLink "
                            f"domains", source)
    if not switched:
        raise TopologyError(f"--nvlink-domain {domain}: hosts share NVLink through NVSwitches, and this "
                            f"machine's GPUs have none", source)


def check_hosts(hosts, nics, source, why):
    """Several hosts need NICs to be joined by; ``why`` says how to get them."""
    if hosts > 1 and not nics:
        raise TopologyError(f"{hosts} hosts are joined through their NICs: {why}", source)


def _link_entry(a, b, bandwidth, count):
    entry = {"a": a, "b": b, "bandwidth": bandwidth_text(bandwidth)}
    if count != 1:
        entry["count"] = count
    return entry


def _per_host(entry, hosts, **loops):
    """``entry`` repeated on every host (``for: {h: hosts}``); on one host, written out for host 0."""
    if hosts == 1:
        entry = {k: v.replace("{h}", "0") if isinstance(v, str) else v for k, v in entry.items()}
        return {**entry, "for": loops} if loops else entry
    return {**entry, "for": {"h": hosts, **loops}}


def _yaml(data):
    """The file's body: top-level keys in block style, every entry on one line in flow style."""
    import yaml
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    parts = []
    for key, value in data.items():
        if isinstance(value, list):
            parts.append(f"{key}:\n" + "".join(
                "  - " + yaml.dump(item, Dumper=dumper, default_flow_style=True, sort_keys=False, width=1000)
                for item in value))
        else:
            parts.append(yaml.dump({key: value}, Dumper=dumper, sort_keys=False, width=1000,
                                   default_flow_style=None if isinstance(value, dict) else False))
    return "".join(parts)


def parse_rate(text, option):
    """A positive bandwidth given on the command line (``25GB/s``, ``200Gbit/s``)."""
    value = parse_bandwidth(text)
    if not value > 0:
        raise ValueError(f"{option} must be a positive bandwidth such as 25GB/s, got {text!r}")
    return value

"""A topology file from NCCL's topology XML (``NCCL_TOPO_DUMP_FILE``): one machine as NCCL sees it.

NCCL writes, for the node it runs on, the tree it detected: ``<cpu numaid=...>`` for every NUMA node,
``<pci busid link_speed link_width>`` for every PCIe bridge and device below it, ``<gpu dev sm>``
with its ``<nvlink target count tclass>`` links (``tclass 0x068000``: an NVSwitch), and ``<nic>`` with
its ``<net name speed>`` ports (speed in Mbit/s). Unlike ``nvidia-smi topo -m`` it says how wide and
fast every PCIe link is and how fast every NIC, so only NVLink's rate per link (from the GPU's
compute capability) and the link between NUMA nodes are assumed. PCIe rates are what DMA achieves
per lane, as in the zoo's files (Gen3 x16 12 GB/s, Gen4 25, Gen5 50).

A GPU may also reach its CPU directly: through NVLink-C2C on Grace machines (``<c2c bw count>``, the
rate per link in MB/s, as NVML reports it) or through NVLinks into a POWER9 CPU (``tclass
0x068001``). That link joins the GPU to its NUMA node at its own rate; where the GPU's PCIe link
leads to the same NUMA node, the faster of the two stands (a Grace GPU's PCIe link may read 2.5 GT/s,
which no data crosses).
"""
import re
import xml.etree.ElementTree as ElementTree

from .errors import TopologyError
from .node_import import DEFAULT_CPU_LINK, NodeWriter, check_hosts, check_nvlink_domain, header, pick
from .units import counted, format_bandwidth

# bytes/s per lane and direction that GPU DMA achieves, by the link's GT/s (3/4 of Gen3's raw rate, as
# bandwidthTest measures on an x16 slot: 12 GB/s)
PCIE_LANE = {2.5: 0.2e9, 5.0: 0.4e9, 8.0: 0.75e9, 16.0: 1.5625e9, 32.0: 3.125e9, 64.0: 6.25e9}
NVSWITCH_CLASS = "0x068000"
CPU_NVLINK_CLASS = "0x068001"   # the far end of a POWER9 CPU's NVLinks
INVISIBLE = re.compile(r"f+:f+:f+(\.[0-9a-f])?")   # NCCL's target for an NVLink peer it cannot see (fffffff:ff:ff.0)


def nvlink_rate(sm):
    """NVLink's rate per link per direction for compute capability ``sm`` (60 = P100 ...), None if
    unknown: NVLink 1.0 20 GB/s, 2.0-4.0 25 GB/s (GA10x bridges 14.0625), 5.0 50 GB/s."""
    if sm is None or sm < 60:
        return None
    if sm in (86, 87, 89):
        return 14.0625e9
    return 20e9 if sm < 70 else 25e9 if sm < 100 else 50e9


def read_xml(text, source="<stdin>"):
    """The ``<system>`` element of an NCCL topology XML."""
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as exc:
        line, column = exc.position
        raise TopologyError(f"not well-formed XML at line {line}, column {column + 1}; pass the file "
                            f"NCCL_TOPO_DUMP_FILE wrote", source) from None
    if root.tag != "system":
        raise TopologyError(f"the root element is <{root.tag}>, not NCCL's <system>; pass the file "
                            f"NCCL_TOPO_DUMP_FILE wrote", source)
    if root.find(".//gpu") is None:
        raise TopologyError("the XML lists no <gpu>: dump it from a job that uses this node's GPUs", source)
    return root


def topology(root, name, source="<stdin>", nvlink=None, pcie=None, cpu_link=DEFAULT_CPU_LINK, hosts=1,
             nic_bandwidth=None, nics=None, gpus=None, nvlink_domain=None):
    """The topology of ``hosts`` machines like the one ``root`` (from :func:`read_xml`) describes, as
    YAML text with its header. ``nvlink``, ``pcie`` and ``nic_bandwidth`` (bytes/s per direction)
    replace the file's rates; ``nics`` picks NIC ports by name, ``gpus`` the GPUs that are ranks by
    ``dev`` (default: all); ``nvlink_domain`` hosts in a row share their NVSwitches (multi-node
    NVLink). Raises :class:`TopologyError` where the file and options leave a rate unknown or name
    what the machine lacks, and where the GPUs' NVSwitches lie outside the node (NCCL cannot see
    them: multi-node NVLink, as in GB200 NVL72) but several hosts were asked for without saying how
    many share them."""
    all_gpus = sorted(root.iter("gpu"), key=lambda g: _int(g, "dev", source))
    devs = [_int(g, "dev", source) for g in all_gpus]
    if len(set(devs)) < len(devs):
        parts = sorted({g.get("mlopart") for g in all_gpus if g.get("mlopart") is not None})
        if parts:
            raise TopologyError(f"the GPUs are split into MLOPart partitions (<gpu mlopart={', '.join(parts)}>), "
                                f"several ranks on one GPU; ddl models whole GPUs, one rank each: dump the XML "
                                f"from a job without MLOPart", source)
        raise TopologyError("two <gpu> elements have the same dev; pass one node's XML", source)
    ranks = pick(all_gpus, gpus, dict(zip(devs, all_gpus)), "GPU", "--gpus", source, list(map(str, devs)))
    all_nets = list(root.iter("net"))
    kept_nets = pick(all_nets, nics, {n.get("name"): n for n in all_nets}, "NIC", "--nics", source,
                     [n.get("name", "?") for n in all_nets])
    check_hosts(hosts, kept_nets, source, "the XML lists none; dump it on a node with its network cards")
    reader = _Reader(root, source, hosts, set(ranks) | set(kept_nets), nvlink, pcie, nic_bandwidth,
                     nvlink_domain or 1)
    for k, cpu in enumerate(root.findall("cpu")):
        if not reader.holds_kept(cpu):
            continue
        numa = cpu.get("numaid", "")
        known = re.fullmatch(r"0x[0-9a-f]+|[0-9]+", numa.strip(), re.I)
        vertex = reader.node(f"h{{h}}/numa{_int(cpu, 'numaid', source)}" if known else f"h{{h}}/cpu{k}", "cpu")
        reader.cpu = vertex
        reader.walk(cpu, vertex, pcie)
    reader.nvlinks()
    check_nvlink_domain(hosts, nvlink_domain, reader._switched, source)
    if reader.outside_nvswitches and hosts > 1 and nvlink_domain is None:
        raise TopologyError("the GPUs' NVLinks lead to NVSwitches outside this node (multi-node NVLink, as in "
                            "GB200 NVL72), which other hosts may share: give --nvlink-domain N, the hosts per "
                            "NVLink domain (18 trays in an NVL72 rack; 1 if no two hosts share them)", source)
    reader.sockets(cpu_link)
    rates = sorted({format_bandwidth(r) for r in reader.nvlink_rates})
    assumed = ([f"NVLink {', '.join(rates)} per link" + ("" if nvlink else " (by compute capability; --nvlink)")]
               if rates else []) + [
        f"PCIe {format_bandwidth(pcie)} (--pcie)" if pcie else
        "PCIe per lane what DMA achieves: Gen3 0.75 GB/s, Gen4 1.5625, Gen5 3.125 (--pcie)"
        ] + reader.assumptions(cpu_link, reader.nics, nic_bandwidth is not None)
    found = ", ".join(part for part in (
        f"{len(ranks)} of {len(all_gpus)} GPUs as ranks", reader.nvlink_words(), reader.cpu_link_words(),
        reader.counts(),
        f"NICs {', '.join(n.get('name') for n in kept_nets)}" if kept_nets else None) if part)
    read = ("NCCL topology XML: the PCIe tree with every link's generation and width, the GPUs' NVLinks and "
            "their counts" + (", their C2C links' rates and counts" if reader.c2c else "") + ", the NICs' speeds")
    return reader.text(name, [_int(g, "dev", source) for g in ranks], reader.nics,
                       header(source, "NCCL topology XML", found, read, [a for a in assumed if a]))


def _int(elem, key, source):
    text = elem.get(key, "").strip()
    try:
        return int(text, 16 if text.lower().startswith("0x") else 10)
    except ValueError:
        raise TopologyError(f"<{elem.tag}> has {key}={elem.get(key)!r}, not a number", source) from None


def _pcie_rate(pci):
    """A ``<pci>`` link's rate from its ``link_speed`` ("16.0 GT/s PCIe") and ``link_width``, or None."""
    speed = re.match(r"\s*([0-9.]+)\s*GT/s", pci.get("link_speed", ""))
    width = pci.get("link_width", "")
    lane = PCIE_LANE.get(float(speed.group(1))) if speed else None
    return lane * int(width) if lane and width.isdigit() and int(width) > 0 else None


class _Reader(NodeWriter):
    """Walks NCCL's tree, writing the devices it keeps and the switches above them."""

    def __init__(self, root, source, hosts, keep, nvlink, pcie, nic_bandwidth, nvlink_domain):
        super().__init__(hosts, nvlink_domain)
        self.source, self.keep, self.nvlink, self.pcie, self.nic_bandwidth = source, keep, nvlink, pcie, nic_bandwidth
        self.gpu_at = {}            # busid -> GPU vertex, for NVLink targets
        self.pending = []           # (GPU vertex, <gpu>) whose NVLinks are read once every GPU is known
        self.nics, self.nvlink_rates = [], set()
        self._switched, self._pairs = {}, {}
        self.cpu = None             # the NUMA node vertex being walked
        self.outside_nvswitches = False    # NVLinks into switches this node does not see (multi-node NVLink)
        self.c2c, self.cpu_nvlinks = {}, {}    # GPU vertex -> its rate to its CPU by that link

    def walk(self, elem, parent, rate):
        """The children of ``elem``, which hangs from vertex ``parent`` by a link of ``rate``."""
        for child in elem:
            if child.tag == "nic":
                self._nic(child, parent, rate)
            elif child.tag != "pci" or not self.holds_kept(child):
                continue
            elif child.find("gpu") is not None:
                self._gpu(child, child.find("gpu"), parent, rate)
            elif child.find("nic") is not None:
                self._nic(child.find("nic"), parent, self._rate(child, rate))
            else:
                link = self._rate(child, rate)
                self.walk(child, self.switch(parent, link), link)

    def holds_kept(self, elem):
        return any(e in self.keep for e in elem.iter() if e.tag in ("gpu", "net"))

    def _rate(self, pci, inherited):
        rate = self.pcie or _pcie_rate(pci) or inherited
        if rate is None:
            raise TopologyError(f"<pci busid={pci.get('busid')!r}> gives no link speed and width: give --pcie "
                                f"(e.g. 25GB/s)", self.source)
        return rate

    def _gpu(self, pci, gpu, parent, inherited):
        if gpu not in self.keep:
            return
        vertex = self.node(f"h{{h}}/gpu{_int(gpu, 'dev', self.source)}", "gpu")
        pcie = self._rate(pci, inherited)
        to_cpu = self._to_cpu(vertex, gpu)
        if to_cpu and parent == self.cpu:
            self.link(vertex, parent, max(pcie, to_cpu))
        else:
            self.link(vertex, parent, pcie)
            if to_cpu:
                self.link(vertex, self.cpu, to_cpu)
        self.gpu_at[pci.get("busid", "").lower()] = vertex
        self.pending.append((vertex, gpu))

    def _to_cpu(self, vertex, gpu):
        """The rate (bytes/s per direction) of ``gpu``'s own links to its CPU, 0 if it has none:
        NVLink-C2C (``bw`` MB/s per link, ``count`` links) and NVLinks into a POWER9 CPU."""
        c2c = sum(_int(c, "bw", self.source) * 1e6 * _int(c, "count", self.source) for c in gpu.iter("c2c"))
        links = sum(_int(n, "count", self.source) for n in gpu.iter("nvlink")
                    if n.get("tclass", "").lower() == CPU_NVLINK_CLASS)
        if c2c:
            self.c2c[vertex] = c2c
        if links:
            self.cpu_nvlinks[vertex] = links * self._nvlink_rate(gpu)
        return c2c + self.cpu_nvlinks.get(vertex, 0)

    def _nic(self, nic, parent, pcie_rate):
        for net in nic.iter("net"):
            if net not in self.keep:
                continue
            name = re.sub(r"[/{}\s]", "_", net.get("name", "") or f"nic{len(self.nics)}").lower()
            speed = self.nic_bandwidth or (float(net.get("speed", "0") or 0) * 1e6 / 8)
            if not speed > 0:
                raise TopologyError(f"<net name={net.get('name')!r}> gives no speed: give --nic-bandwidth "
                                    f"(e.g. 200Gbit/s), or leave it out with --nics", self.source)
            vertex = self.node(f"h{{h}}/{name}", "nic")
            self.link(vertex, parent, min(speed, pcie_rate) if pcie_rate else speed)
            self.nics.append((vertex, speed))

    def nvlinks(self):
        """Every kept GPU's NVLinks: to another kept GPU, or into the NVSwitches (one vertex)."""
        for vertex, gpu in self.pending:
            for link in gpu.iter("nvlink"):
                rate = self._nvlink_rate(gpu)
                count = _int(link, "count", self.source)
                target = link.get("target", "").lower()
                if link.get("tclass", NVSWITCH_CLASS) == NVSWITCH_CLASS and target not in self.gpu_at:
                    self._switched[vertex] = self._switched.get(vertex, 0) + count
                    self.outside_nvswitches |= bool(INVISIBLE.fullmatch(target))
                elif target in self.gpu_at:
                    self._pairs.setdefault(frozenset((vertex, self.gpu_at[target])), (count, rate))
                self.nvlink_rates.add(rate)
        for pair, (count, rate) in self._pairs.items():
            self.link(*sorted(pair), rate, count=count)
        if self._switched:
            self.nvswitch(list(self._switched), max(self.nvlink_rates), self._switched)

    def _nvlink_rate(self, gpu):
        rate = self.nvlink or nvlink_rate(int(gpu.get("sm", "0") or 0))
        if rate is None:
            raise TopologyError(f"<gpu dev={gpu.get('dev')!r} sm={gpu.get('sm')!r}> has NVLinks of no known "
                                f"rate: give --nvlink (e.g. 25GB/s)", self.source)
        return rate

    def cpu_link_words(self):
        """The header's words on GPUs joined to their CPU by C2C or NVLink."""
        words = [f"{what} to the CPU on {counted(len(rates), 'GPU')} "
                 f"({', '.join(sorted({format_bandwidth(r) for r in rates.values()}))})"
                 for what, rates in (("NVLink-C2C", self.c2c), ("NVLink", self.cpu_nvlinks)) if rates]
        return ", ".join(words) or None

    def nvlink_words(self):
        if self._switched:
            return (f"NVSwitch ({'/'.join(map(str, sorted(set(self._switched.values()))))} links per GPU"
                    + (", the switches outside the node)" if self.outside_nvswitches else ")"))
        return f"NVLink between {len(self._pairs)} GPU pairs" if self._pairs else None

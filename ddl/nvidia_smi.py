"""A topology file from ``nvidia-smi topo -m``: what a user of a real cluster already has.

nvidia-smi's matrix names, for every pair of devices in one machine (GPUs and NICs), the kind of path
between them: ``NV#`` (a bonded set of # NVLinks), ``PIX`` (at most one PCIe switch), ``PXB`` (several
PCIe switches, no host bridge), ``PHB`` (through a PCIe host bridge: the CPU), ``NODE`` (between host
bridges of one NUMA node), ``SYS`` (across the interconnect between NUMA nodes; ``SOC`` in old
drivers). It says nothing of speeds, nor of what joins machines: those come from the caller (a GPU
generation's NVLink and PCIe rates, the NICs' rate, the number of hosts) and are written into the
file's header, so that whoever reads the file sees what was measured and what was assumed.

The PCIe tree is rebuilt by single linkage over the path kinds: devices joined by paths no longer than
``PIX`` share a switch, no longer than ``PXB`` a tree of switches under one root port, no longer than
``NODE`` a NUMA node (a ``cpu`` vertex; the matrix's NUMA and CPU affinity columns join GPUs too). An
NVLink hides the PCIe path between two GPUs, so such a pair is joined only through a device that
both have a PCIe path to (on a DGX, the NICs beside them). Every GPU pair showing the same ``NV#``,
more links than one GPU has in all (at most 18), is an NVSwitch system: one ``nvswitch`` vertex
with # links per GPU, as the zoo's DGX files model it.
"""
import re
from collections import namedtuple

import networkx as nx

from .errors import TopologyError
from .node_import import DEFAULT_CPU_LINK, NodeWriter, check_hosts, check_nvlink_domain, header, pick
from .units import format_bandwidth

# PCIe path kinds, shortest first; SOC is what drivers before 2017 called SYS.
PATH_LEVELS = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5}
_PIX, _PXB, _NODE = 1, 2, 4
MAX_NVLINKS_PER_GPU = 18        # H100 and B200; more NV links per GPU than this go through NVSwitches

Preset = namedtuple("Preset", "nvlink pcie what")
GPU_PRESETS = {
    # per direction; PCIe as GPU DMA achieves it on an x16 slot, as in the zoo's files
    "p100": Preset(20e9, 12e9, "NVLink 1.0 20 GB/s per link, PCIe Gen3 x16 12 GB/s"),
    "v100": Preset(25e9, 12e9, "NVLink 2.0 25 GB/s per link, PCIe Gen3 x16 12 GB/s"),
    "a100": Preset(25e9, 25e9, "NVLink 3.0 25 GB/s per link, PCIe Gen4 x16 25 GB/s"),
    "h100": Preset(25e9, 50e9, "NVLink 4.0 25 GB/s per link, PCIe Gen5 x16 50 GB/s"),
    "b200": Preset(50e9, 50e9, "NVLink 5.0 50 GB/s per link, PCIe Gen5 x16 50 GB/s"),
}

Matrix = namedtuple("Matrix", "devices paths numa cpus names source")
Matrix.__doc__ = """One machine's ``nvidia-smi topo -m``.

``devices``: column names in order (``GPU0``, ``NIC0`` or ``mlx5_0``); ``paths``: ``{(a, b): 'NV12'}``
for every ordered pair of distinct devices; ``numa``/``cpus``: a GPU's NUMA and CPU affinity columns
(absent when not given); ``names``: the NIC legend (``NIC0`` -> ``mlx5_0``); ``source``: for messages."""


def read_matrix(text, source="<stdin>"):
    """Parse the text ``nvidia-smi topo -m`` prints into a :class:`Matrix`."""
    lines = [line.rstrip() for line in text.replace("\r", "").split("\n")]
    start = next((k for k, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
    if start is None:
        already = (" (it reads as a ddl topology file already: give it to `ddl topo show` or `ddl plan`)"
                   if re.search(r"^(nodes|tiers)\s*:", text, re.M) and re.search(r"^name\s*:", text, re.M) else "")
        raise TopologyError("this is not the output of `nvidia-smi topo -m` (no header line starting "
                            f"with GPU0){already}; save it on one node with `nvidia-smi topo -m > topo.txt`", source)
    header = lines[start].split()
    first_extra = next((k for k, word in enumerate(header) if word in ("CPU", "NUMA")), len(header))
    devices = header[:first_extra]
    extras = re.findall(r"CPU Affinity|NUMA Affinity|GPU NUMA ID", " ".join(header[first_extra:]))
    rows = {}
    for number, line in enumerate(lines[start + 1:], start + 2):
        words = line.split()
        if not words or words[0] not in devices:
            if words and words[0].rstrip(":") == "Legend":
                break
            continue
        if words[0] in rows:
            raise TopologyError(f"line {number}: a second row for {words[0]}; pass one machine's matrix",
                                source)
        if len(words) < len(devices) + 1:
            raise TopologyError(f"line {number}: row {words[0]} has {len(words) - 1} entries for "
                                f"{len(devices)} columns; pass the matrix as nvidia-smi printed it", source)
        rows[words[0]] = (number, words[1:len(devices) + 1], dict(zip(extras, words[len(devices) + 1:])))
    missing = [d for d in devices if d not in rows]
    if missing:
        raise TopologyError(f"no row for {', '.join(missing)}; pass the whole matrix", source)
    paths, numa, cpus = {}, {}, {}
    for a, (number, cells, extra) in rows.items():
        for b, cell in zip(devices, cells):
            if (cell == "X") != (a == b) or not (cell == "X" or cell in PATH_LEVELS
                                                 or re.fullmatch(r"NV[1-9][0-9]*", cell)):
                raise TopologyError(f"line {number}: row {a}, column {b}: {cell!r} is not a path kind "
                                    f"nvidia-smi prints (X on the diagonal; NV#, PIX, PXB, PHB, NODE "
                                    f"or SYS elsewhere)", source)
            if _nvlinks(cell) > MAX_NVLINKS_PER_GPU:
                raise TopologyError(f"line {number}: row {a}, column {b}: {cell} bonds {_nvlinks(cell)} NVLinks, "
                                    f"more than a GPU has (at most {MAX_NVLINKS_PER_GPU}); pass the matrix as "
                                    f"nvidia-smi printed it", source)
            if a != b:
                paths[a, b] = cell
        if extra.get("NUMA Affinity", "").isdigit():
            numa[a] = int(extra["NUMA Affinity"])
        if extra.get("CPU Affinity", "N/A") != "N/A":
            cpus[a] = extra["CPU Affinity"]
    for (a, b), cell in paths.items():
        if paths[b, a] != cell:
            raise TopologyError(f"row {a} says {cell} to {b} but row {b} says {paths[b, a]} to {a}; "
                                f"pass the matrix as nvidia-smi printed it", source)
    names = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", "\n".join(lines[start:]), re.M))
    if not any(_is_gpu(d) for d in devices):
        raise TopologyError("the matrix lists no GPU", source)
    return Matrix(tuple(devices), paths, numa, cpus, names, source)


def _is_gpu(device):
    return re.fullmatch(r"GPU\d+", device) is not None


def _nvlinks(cell):
    return int(cell[2:]) if cell.startswith("NV") else 0


def topology(matrix, name, gpu=None, nvlink=None, pcie=None, cpu_link=DEFAULT_CPU_LINK, hosts=1,
             nic_bandwidth=None, nics=None, gpus=None, nvswitch="auto", nvlink_domain=None):
    """The topology of ``hosts`` machines like ``matrix``'s, as a YAML text with its header comment.

    ``gpu`` names a preset of :data:`GPU_PRESETS` for the NVLink and PCIe rates; ``nvlink`` (per link)
    and ``pcie`` (bytes/s per direction) override it. ``nic_bandwidth`` puts the NICs in the file (each
    on its PCIe switch; with ``hosts > 1`` every NIC links to one non-blocking switch ``fabric``);
    ``nics`` picks them by column or legend name (default: all), ``gpus`` the GPUs that are ranks by
    index (default: all). ``nvswitch`` is ``'auto'``, ``'yes'`` or ``'no'``; ``nvlink_domain`` hosts in a
    row share their NVSwitches (multi-node NVLink; default: each host its own). Raises
    :class:`TopologyError` for what the matrix and the options cannot make into a topology."""
    source = matrix.source
    all_gpus = [d for d in matrix.devices if _is_gpu(d)]
    shown = any(_nvlinks(matrix.paths[a, b]) for a in all_gpus for b in all_gpus if a != b)
    preset, nvlink, pcie = _rates(gpu, nvlink, pcie, shown, source)
    if hosts > 1 and nic_bandwidth is None:
        raise TopologyError(f"{hosts} hosts are joined through their NICs: say how fast they are with "
                            f"--nic-bandwidth (e.g. 200Gbit/s)", source)
    ranks = pick(all_gpus, gpus, {int(d[3:]): d for d in all_gpus}, "GPU", "--gpus", source,
                 [d[3:] for d in all_gpus])
    all_nics = [d for d in matrix.devices if not _is_gpu(d)]
    by_name = {**{d: d for d in all_nics}, **{matrix.names.get(d, d): d for d in all_nics}}
    chosen_nics = pick(all_nics, nics, by_name, "NIC", "--nics", source,
                       [_nic_name(matrix, d) for d in all_nics]) if nic_bandwidth else []
    check_hosts(hosts, chosen_nics, source, "the matrix lists none; run nvidia-smi on a node with its "
                                            "network cards installed")
    switched = _nvswitch(matrix, all_gpus, nvswitch)
    check_nvlink_domain(hosts, nvlink_domain, switched, source)
    b = _Builder(matrix, hosts, pcie, nic_bandwidth, nvlink_domain or 1)
    b.place(ranks + chosen_nics)
    b.nvlinks(ranks, nvlink, switched)
    b.sockets(cpu_link)
    nic_rates = [(b.vid(n), nic_bandwidth) for n in chosen_nics]
    assumed = [f"NVLink {format_bandwidth(nvlink)} per link" if shown else None,
               f"PCIe {format_bandwidth(pcie)}" + (f" ({preset.what})" if preset else "")
               ] + b.assumptions(cpu_link, nic_rates, True)
    found = ", ".join(part for part in (
        f"{len(ranks)} of {len(all_gpus)} GPUs as ranks",
        f"{'NVSwitch' if switched else 'NVLink'} between them" if shown else None, b.counts(),
        f"NICs {', '.join(matrix.names.get(n, n) for n in chosen_nics)}" if chosen_nics else None) if part)
    read = ("matrix: which GPUs are NVLinked and by how many links, which devices share a PCIe switch (PIX), a "
            "tree of switches (PXB) or a NUMA node (PHB, NODE)")
    return b.text(name, [int(g[3:]) for g in ranks], nic_rates,
                  header(source, "nvidia-smi topo -m", found, read, [a for a in assumed if a]))


def _rates(gpu, nvlink, pcie, shown, source):
    """The preset ``gpu`` names and the NVLink and PCIe rates, the options' before the preset's."""
    preset = GPU_PRESETS.get(gpu)
    if gpu is not None and preset is None:
        raise TopologyError(f"unknown GPU {gpu!r}; choose one of {', '.join(GPU_PRESETS)} or give --nvlink "
                            f"and --pcie", source)
    nvlink = nvlink or (preset.nvlink if preset else None)
    pcie = pcie or (preset.pcie if preset else None)
    unknown = [what for what, rate in (("NVLink", nvlink if shown else 0), ("PCIe", pcie)) if rate is None]
    if unknown:
        raise TopologyError(f"the matrix does not say how fast {' and '.join(unknown)} "
                            f"{'are' if len(unknown) > 1 else 'is'}: give --gpu (one of "
                            f"{', '.join(GPU_PRESETS)}), or " +
                            " and ".join(f"--{what.lower()} 25GB/s" for what in unknown), source)
    return preset, nvlink, pcie



def _nic_name(matrix, device):
    """``NIC0 (mlx5_0)``, or the column's own name where the legend gives none."""
    return f"{device} ({matrix.names[device]})" if device in matrix.names else device


def _nvswitch(matrix, gpus, mode):
    """NVLinks per GPU into an NVSwitch (0: links go GPU to GPU)."""
    cells = {matrix.paths[a, b] for a in gpus for b in gpus if a != b}
    uniform = len(cells) == 1 and _nvlinks(next(iter(cells)))
    if mode == "yes" and not uniform:
        raise TopologyError("--nvswitch yes: every GPU pair must show the same NV# (an NVSwitch joins "
                            "all of them alike)", matrix.source)
    if mode == "no" or not uniform:
        return 0
    links = _nvlinks(next(iter(cells)))
    return links if mode == "yes" or links * (len(gpus) - 1) > MAX_NVLINKS_PER_GPU else 0


class _Builder(NodeWriter):
    """The machine the matrix implies: its devices in PCIe trees under their NUMA nodes."""

    def __init__(self, matrix, hosts, pcie, nic_bandwidth, nvlink_domain):
        super().__init__(hosts, nvlink_domain)
        self.matrix, self.pcie, self.nic_bandwidth = matrix, pcie, nic_bandwidth

    def vid(self, device):
        """A device's vertex id: ``h{h}/gpu3``, or the NIC's legend name (``h{h}/mlx5_0``)."""
        return f"h{{h}}/gpu{device[3:]}" if _is_gpu(device) else \
            f"h{{h}}/{self.matrix.names.get(device, device).lower()}"

    def place(self, devices):
        """Put ``devices`` in the PCIe tree of their NUMA node: switches, trees of switches, CPUs."""
        for d in devices:
            self.node(self.vid(d), "gpu" if _is_gpu(d) else "nic")
        keep = set(devices)
        for socket in _groups(self.matrix, self.matrix.devices, _NODE, same_socket=True):
            if not keep & set(socket):
                continue
            numa = {self.matrix.numa.get(d) for d in socket} - {None}
            cpu = self.node(f"h{{h}}/numa{numa.pop()}" if len(numa) == 1 else f"h{{h}}/cpu{len(self.cpus)}",
                            "cpu")
            for tree in _groups(self.matrix, socket, _PXB):
                self._tree(cpu, _groups(self.matrix, tree, _PIX), keep)

    def nvlinks(self, gpus, rate, switched):
        """Each pair's NV# links, or ``switched`` links from every GPU into one NVSwitch."""
        if switched:
            self.nvswitch([self.vid(g) for g in gpus], rate, {self.vid(g): switched for g in gpus})
            return
        for i, g in enumerate(gpus):
            for h in gpus[i + 1:]:
                if _nvlinks(self.matrix.paths[g, h]):
                    self.link(self.vid(g), self.vid(h), rate, count=_nvlinks(self.matrix.paths[g, h]))

    def _tree(self, cpu, switches, keep):
        """One root port's devices; ``switches`` are its groups that share one PCIe switch.

        The matrix does not say which switch of a tree is nearest the CPU, nor how wide the links
        between switches are. The fewest switches that explain it: the largest group's switch is the
        root (on the CPU), the devices alone in their group hang from it, and every other group has a
        switch of its own below it, whose uplink its devices share."""
        switches = [s for s in ([d for d in s if d in keep] for s in switches) if s]
        if len(switches) == 1 and len(switches[0]) == 1:
            self.link(self.vid(switches[0][0]), cpu, self._rate(switches[0][0]))
        elif switches:
            root = max(switches, key=len)
            top = self.switch(cpu, self.pcie)
            for group in switches:
                below = top if group is root or len(group) == 1 else self.switch(top, self.pcie)
                for d in group:
                    self.link(self.vid(d), below, self._rate(d))

    def _rate(self, device):
        return self.pcie if _is_gpu(device) else self.nic_bandwidth


def _groups(matrix, devices, level, same_socket=False):
    """``devices`` joined by PCIe paths no longer than ``level`` (and, for sockets, by equal NUMA or
    CPU affinity), each group in matrix order, groups in the order of their first device."""
    graph = nx.Graph()
    graph.add_nodes_from(devices)
    graph.add_edges_from((a, b) for a in devices for b in devices
                         if a < b and PATH_LEVELS.get(matrix.paths[a, b], 99) <= level)
    if same_socket:
        for column in (matrix.numa, matrix.cpus):
            graph.add_edges_from((a, b) for a in devices for b in devices
                                 if a < b and a in column and column.get(b) == column[a])
    order = {d: k for k, d in enumerate(matrix.devices)}
    groups = [sorted(c, key=order.get) for c in nx.connected_components(graph)]
    return sorted(groups, key=lambda g: order[g[0]])

"""`ddl topo import` of NCCL's topology XML (NCCL_TOPO_DUMP_FILE).

The files in tests/nccl_xml/ are written in NCCL's format for machines the zoo describes by hand (DGX-1
V100, DGX A100 with its NPS4 NUMA nodes and two storage NICs). Imported, they give the zoo's bounds;
where the XML leaves a rate unknown, the import asks for it by name.
"""
import os
import re
import subprocess
import sys

import pytest
import yaml

from ddl import bounds, nccl_xml, nvidia_smi
from ddl.errors import TopologyError
from ddl.topology import Topology

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMPUTE_NICS = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
GB = 1e9


def text_of(name):
    with open(os.path.join(HERE, "nccl_xml", name), encoding="utf-8") as f:
        return f.read()


def imported(text, **options):
    out = nccl_xml.topology(nccl_xml.read_xml(text, "t.xml"), "t", "t.xml", **options)
    return Topology.from_dict(yaml.safe_load(out)), out


def zoo(name):
    return Topology.load(os.path.join(ROOT, "topologies", name))


@pytest.mark.parametrize("hosts, algbw", [(2, 346.67), (4, 266.67)])
def test_dgx_a100_boxes_reach_forestcolls_optimum(hosts, algbw):
    topo, text = imported(text_of("dgx-a100.xml"), hosts=hosts, nics=COMPUTE_NICS)
    box = zoo(f"dgx-a100-{hosts}x8.yaml")
    assert round(bounds.cut_bound(topo).algbw / GB, 2) == algbw
    assert bounds.allreduce_bound(topo).seconds_per_byte == pytest.approx(bounds.allreduce_bound(box).seconds_per_byte)
    graph = topo.usable_graph()
    assert graph["h0/gpu5"]["h0/nvswitch"]["capacity"] == 12 * 25 * GB     # 6 NVSwitches x 2 links
    assert graph["h1/mlx5_9"]["fabric"]["capacity"] == 25 * GB               # speed="200000" (Mbit/s)
    assert graph["h0/gpu0"]["h0/pcie1"]["capacity"] == 25 * GB               # 16 GT/s x 16 lanes
    assert not any("mlx5_4" in v or v.endswith("numa0") for v in graph)     # storage NICs and their node left out
    assert "NVSwitch (12 links per GPU), 4 NUMA nodes" in " ".join(text.replace("#", "").split())


def test_dgx1_gives_the_zoo_files_bounds_as_the_matrix_does():
    topo, _ = imported(text_of("dgx1-v100.xml"))
    for other in (zoo("dgx1-v100.yaml"), Topology.from_dict(yaml.safe_load(nvidia_smi.topology(
            nvidia_smi.read_matrix(open(os.path.join(HERE, "nvidia_smi", "dgx1-v100.txt")).read(), "m"), "m",
            gpu="v100")))):
        assert bounds.transfer_bound(topo).bandwidth == pytest.approx(bounds.transfer_bound(other).bandwidth)
        assert bounds.cut_bound(topo).algbw == pytest.approx(bounds.cut_bound(other).algbw)
    graph = topo.usable_graph()
    assert graph["h0/gpu0"]["h0/gpu4"]["capacity"] == 2 * 25 * GB and not graph.has_edge("h0/gpu0", "h0/gpu5")
    assert graph["h0/mlx5_0"]["h0/pcie0"]["capacity"] == 12 * GB      # 100 Gbit/s NIC behind a Gen3 x16 slot


def test_a_fragment_keeps_only_its_gpus_and_their_links():
    topo, _ = imported(text_of("dgx1-v100.xml"), gpus=[0, 1, 4, 5], nics=[])
    assert list(topo.ranks) == ["h0/gpu0", "h0/gpu1", "h0/gpu4", "h0/gpu5"]
    assert {v for v in topo.nodes if topo.kind(v) in ("gpu", "nic")} == set(topo.ranks)
    fragment = zoo("dgx1-v100.yaml").with_ranks([f"dgx1/gpu{g}" for g in (0, 1, 4, 5)])
    assert bounds.cut_bound(topo).algbw == pytest.approx(bounds.cut_bound(fragment).algbw)
    assert bounds.allreduce_bound(topo).seconds_per_byte == pytest.approx(
        bounds.allreduce_bound(fragment).seconds_per_byte)


def test_unknown_widths_inherit_the_bridge_above():
    text = re.sub(r'link_speed="8.0 GT/s PCIe" link_width="16">(\s*<gpu)', r'link_speed="" link_width="0">\1',
                  text_of("dgx1-v100.xml"))
    assert 'link_width="0"' in text
    topo, _ = imported(text)
    assert topo.usable_graph()["h0/gpu0"]["h0/pcie0"]["capacity"] == 12 * GB


@pytest.mark.parametrize("edit, options, words", [
    (lambda t: t.replace('link_width="16"', 'link_width="0"'), {}, ["gives no link speed and width", "--pcie"]),
    (lambda t: t.replace('sm="70"', 'sm="0"'), {}, ["NVLinks of no known rate", "--nvlink"]),
    (lambda t: t.replace('speed="100000"', 'speed="0"'), {}, ["<net name='mlx5_0'> gives no speed", "--nics"]),
    (lambda t: t, {"gpus": [0, 8]}, ["--gpus: the machine has no GPU 8"]),
    (lambda t: t, {"hosts": 2, "nics": []}, ["2 hosts are joined through their NICs"]),
    (lambda t: t.replace('dev="1"', 'dev="0"', 1), {}, ["the same dev"]),
])
def test_what_the_xml_leaves_unknown_is_asked_for(edit, options, words):
    with pytest.raises(TopologyError) as err:
        imported(edit(text_of("dgx1-v100.xml")), **options)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("edit, options", [
    (lambda t: t.replace('link_width="16"', 'link_width="0"'), {"pcie": 12 * GB}),
    (lambda t: t.replace('sm="70"', 'sm="0"'), {"nvlink": 25 * GB}),
    (lambda t: t.replace('speed="100000"', 'speed="0"'), {"nic_bandwidth": 12.5 * GB}),
])
def test_an_option_gives_what_the_xml_does_not(edit, options):
    topo, text = imported(edit(text_of("dgx1-v100.xml")), **options)
    assert bounds.transfer_bound(topo).bandwidth == pytest.approx(1248 * GB)


@pytest.mark.parametrize("text, words", [
    ("<system", "not well-formed XML at line 1"),
    ("<topology/>", "the root element is <topology>"),
    ('<system version="1"><cpu numaid="0"/></system>', "lists no <gpu>"),
])
def test_a_file_that_is_not_nccls_is_named(text, words):
    with pytest.raises(TopologyError, match=words):
        nccl_xml.read_xml(text, "x.xml")


def ddl(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "ddl", *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_cli_tells_the_formats_apart(tmp_path):
    out = tmp_path / "boxes.yaml"
    r = ddl("topo", "import", os.path.join(HERE, "nccl_xml", "dgx-a100.xml"), "--hosts", "2", "--nics",
            ",".join(COMPUTE_NICS), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert round(bounds.cut_bound(Topology.load(out)).algbw / GB, 2) == 346.67
    r = ddl("topo", "import", "-", "--gpu", "v100", stdin=text_of("dgx1-v100.xml"))
    assert r.returncode == 2 and "--gpu is for an nvidia-smi matrix" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_numa_ids_as_nccl_writes_them():
    """Decimal, hexadecimal (0x1) or unknown (-1): a CPU vertex each, named by the id where there is one."""
    text = text_of("dgx1-v100.xml").replace('numaid="0"', 'numaid="0x2"').replace('numaid="1"', 'numaid="-1"')
    topo, _ = imported(text)
    assert {v for v in topo.nodes if topo.kind(v) == "cpu"} == {"h0/numa2", "h0/cpu1"}


def test_a_nic_without_a_pci_element_hangs_from_its_cpu_at_its_speed():
    """NCCL lists network devices it found no PCI path for (a bond, a virtual NIC) under the CPU."""
    text = text_of("dgx1-v100.xml").replace(
        '  </cpu>\n', '    <nic>\n      <net name="bond0" dev="4" speed="25000" port="1" gdr="0"/>\n    </nic>\n  </cpu>\n', 1)
    topo, _ = imported(text, hosts=2, nics=["bond0"])
    graph = topo.usable_graph()
    assert graph["h1/bond0"]["h1/numa0"]["capacity"] == 25e9 / 8 == graph["h1/bond0"]["fabric"]["capacity"]
    assert not any("mlx5" in v for v in graph)


# A Grace machine as NCCL writes it (one GPU on the CPU's chip, a 200 Gbit/s NIC behind a Gen5 x4 link):
# the GPU's PCIe link reads 2.5 GT/s, while its data goes over NVLink-C2C, 8 links of 43125 MB/s.
GRACE = """<system version="1">
  <cpu numaid="0" affinity="ffffffff" arch="arm64" vendor="ARM">
    <pci busid="0000:01:00.0" class="0x020000" link_speed="32.0 GT/s PCIe" link_width="4">
      <nic>
        <net name="rocep1s0f0" dev="0" speed="200000" port="1" gdr="0"/>
      </nic>
    </pci>
    <pci busid="000f:01:00.0" class="0x030200" link_speed="2.5 GT/s PCIe" link_width="16">
      <gpu dev="0" sm="121" rank="0" gdr="0">
        <c2c bw="43125" count="8"/>
      </gpu>
    </pci>
  </cpu>
</system>
"""


def header_of(text):
    """The file's header as one line (it is wrapped at 100 columns)."""
    return " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))


def test_a_grace_gpu_reaches_its_cpu_through_c2c():
    topo, text = imported(GRACE, hosts=2)
    graph = topo.usable_graph()
    assert graph["h0/gpu0"]["h0/numa0"]["capacity"] == 8 * 43125e6 == graph["h0/numa0"]["h0/gpu0"]["capacity"]
    assert graph["h1/rocep1s0f0"]["h1/numa0"]["capacity"] == 12.5 * GB    # the NIC's Gen5 x4 link binds
    head = header_of(text)
    assert "NVLink-C2C to the CPU on 1 GPU (345 GB/s)" in head and "C2C links' rates and counts" in head
    # two such machines: the NICs' links set the bound, not the GPU's 3.2 GB/s of PCIe
    assert bounds.allreduce_bound(topo).seconds_per_byte == pytest.approx(1 / (12.5 * GB))
    without, text = imported(GRACE.replace('<c2c bw="43125" count="8"/>', ""), hosts=2)
    assert bounds.allreduce_bound(without).seconds_per_byte == pytest.approx(1 / (3.2 * GB))
    assert "C2C" not in text


def test_nvlinks_into_a_power9_cpu_join_the_gpu_to_it():
    """NCCL names the far end of a POWER9 CPU's NVLinks by PCI class 0x068001; a GPU under a PCIe switch
    keeps its PCIe link and gains one to its NUMA node."""
    text = text_of("dgx1-v100.xml").replace(
        '<nvlink target="0000:16:00.0" count="2" tclass="0x030200"/>',
        '<nvlink target="0000:16:00.0" count="2" tclass="0x030200"/>\n'
        '            <nvlink target="0000:00:00.0" count="3" tclass="0x068001"/>', 1)
    topo, out = imported(text)
    graph = topo.usable_graph()
    assert graph["h0/gpu0"]["h0/numa0"]["capacity"] == 3 * 25 * GB
    assert graph["h0/gpu0"]["h0/pcie0"]["capacity"] == 12 * GB
    assert not graph.has_edge("h0/gpu1", "h0/numa0")
    assert "NVLink to the CPU on 1 GPU (75 GB/s)" in header_of(out)
    with pytest.raises(TopologyError, match="NVLinks of no known rate: give --nvlink"):
        imported(text.replace('sm="70"', 'sm="0"', 1))


def test_a_c2c_link_without_its_numbers_is_named():
    with pytest.raises(TopologyError, match=r"<c2c> has bw='fast', not a number"):
        imported(GRACE.replace('bw="43125"', 'bw="fast"'))


def test_mlopart_partitions_are_refused_by_name():
    """MLOPart lists one GPU as several <gpu> of one dev, a partition each."""
    split = GRACE.replace('<gpu dev="0" sm="121" rank="0" gdr="0">',
                          '<gpu dev="0" sm="121" mlopart="0" rank="0" gdr="0">').replace(
        "      </gpu>\n", '      </gpu>\n      <gpu dev="0" sm="121" mlopart="1" rank="1" gdr="0"/>\n')
    assert split.count("<gpu ") == 2
    with pytest.raises(TopologyError, match=r"MLOPart partitions \(<gpu mlopart=0, 1>\)"):
        imported(split)


def tray(gpus=4):
    """A compute tray of a multi-node NVLink rack as NCCL writes it: two Grace CPUs with two GPUs each
    (C2C), every GPU's 18 NVLinks into NVSwitches outside the tray (a target NCCL cannot see), a 400
    Gbit/s NIC per GPU on its CPU's Gen5 x16."""
    cpus = []
    for c in range(2):
        devices = []
        for k in range(gpus // 2):
            g = c * (gpus // 2) + k
            devices.append(f"""    <pci busid="000{c}:0{k + 1}:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
      <gpu dev="{g}" sm="100" rank="{g}" gdr="1">
        <nvlink target="fffffff:ff:ff.0" count="18" tclass="0x068000"/>
        <c2c bw="44712" count="5"/>
      </gpu>
    </pci>
    <pci busid="000{c}:0{k + 3}:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
      <nic>
        <net name="mlx5_{g}" dev="{g}" speed="400000" port="1" gdr="1"/>
      </nic>
    </pci>""")
        cpus.append(f'  <cpu numaid="{c}" affinity="ffffffff" arch="arm64" vendor="ARM">\n' + "\n".join(devices)
                    + "\n  </cpu>")
    return '<system version="1">\n' + "\n".join(cpus) + "\n</system>\n"


def test_hosts_that_share_their_nvswitches_join_through_them():
    topo, text = imported(tray(), hosts=4, nvlink_domain=2)
    assert {v for v in topo.nodes if v.startswith("nvlink")} == {"nvlink0", "nvlink1"}
    graph = topo.usable_graph()
    assert graph["h1/gpu3"]["nvlink0"]["capacity"] == 18 * 50 * GB and graph["h2/gpu0"].get("nvlink1")
    assert not any(v.endswith("/nvswitch") for v in topo.nodes)
    rank = {v: i for i, v in enumerate(topo.ranks)}
    assert topo.route_bandwidth(rank["h0/gpu0"], rank["h1/gpu2"]) == 900 * GB     # one NVLink domain
    assert topo.route_bandwidth(rank["h0/gpu0"], rank["h2/gpu0"]) == 50 * GB      # across: the NICs
    head = header_of(text)
    assert "the switches outside the node" in head and "NVLink domains of 2 hosts (--nvlink-domain)" in head
    # the allreduce bound (seconds per byte): the cut between domains, crossed by the 16 NICs' 50 GB/s
    # twice per domain boundary (2(k-1) crossings for k domains); in one domain, every GPU's own links
    # (NVLink 900 GB/s and C2C 5 x 44.712) 2(p-1) times
    def bound(domain):
        return bounds.allreduce_bound(imported(tray(), hosts=4, nvlink_domain=domain)[0]).seconds_per_byte
    assert bound(1) == pytest.approx(6 / (16 * 50 * GB))
    assert bound(2) == pytest.approx(2 / (16 * 50 * GB))
    assert bound(4) == pytest.approx(30 / (16 * (900 + 5 * 44.712) * GB))


@pytest.mark.parametrize("text, options, words", [
    (tray(), {"hosts": 4}, "NVSwitches outside this node (multi-node NVLink, as in GB200 NVL72), which other "
                           "hosts may share: give --nvlink-domain N"),
    (tray(), {"hosts": 4, "nvlink_domain": 3}, "--nvlink-domain 3 must divide --hosts 4"),
    (text_of("dgx1-v100.xml"), {"hosts": 2, "nvlink_domain": 2}, "this machine's GPUs have none"),
])
def test_nvlink_domains_that_cannot_be_are_refused(text, options, words):
    with pytest.raises(TopologyError, match=re.escape(words)):
        imported(text, **options)


def test_one_tray_alone_needs_no_domain():
    topo, _ = imported(tray())
    assert topo.nranks == 4 and "h0/nvswitch" in topo.nodes

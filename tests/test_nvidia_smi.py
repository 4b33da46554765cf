"""`ddl topo import`: topology files from `nvidia-smi topo -m`.

The matrices in tests/nvidia_smi/ are written in nvidia-smi's format for machines the zoo describes by
hand (DGX-1 V100 from its whitepaper's numbering, DGX A100 with its NPS4 NUMA nodes and two storage
NICs) and for a PCIe-only box of an older driver's style. An import must give the same fabric as the
hand-written file: the same graph up to names, or the same bounds (ForestColl's optimum).
"""
import os
import subprocess
import sys

import networkx as nx
import pytest
import yaml

from ddl import bounds, nvidia_smi
from ddl.algorithms.hierarchical import hierarchical
from ddl.errors import TopologyError
from ddl.topology import Topology
from ddl.verify import verify

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMPUTE_NICS = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
GB = 1e9


def matrix(name):
    path = os.path.join(HERE, "nvidia_smi", name)
    with open(path, encoding="utf-8") as f:
        return nvidia_smi.read_matrix(f.read(), path)


def imported(name, **options):
    text = nvidia_smi.topology(matrix(name), name.split(".")[0], **options)
    return Topology.from_dict(yaml.safe_load(text)), text


def same_fabric(a, b):
    """Isomorphic graphs with the same vertex kinds and the same capacity on every edge."""
    return nx.is_isomorphic(a.usable_graph(), b.usable_graph(),
                            node_match=lambda x, y: x["kind"] == y["kind"],
                            edge_match=lambda x, y: x["capacity"] == pytest.approx(y["capacity"]))


def edges(topo):
    return {(u, v, d["capacity"] / GB) for u, v, d in topo.usable_graph().edges(data=True) if u < v}


def test_dgx1_is_the_zoo_file_up_to_names():
    topo, text = imported("dgx1-v100.txt", gpu="v100", nic_bandwidth=100e9 / 8)
    zoo = Topology.load(os.path.join(ROOT, "topologies", "dgx1-v100.yaml"))
    assert same_fabric(topo, zoo)
    assert bounds.transfer_bound(topo).bandwidth == pytest.approx(bounds.transfer_bound(zoo).bandwidth)
    assert "NVLink 25 GB/s per link" in text and "PCIe 12 GB/s" in text      # the header says what was assumed
    assert not same_fabric(imported("dgx1-v100.txt", gpu="a100", nic_bandwidth=100e9 / 8)[0], zoo)


@pytest.mark.parametrize("hosts, algbw, limiting", [(2, 346.67, 15), (4, 266.67, 24)])
def test_dgx_a100_boxes_reach_forestcolls_optimum(hosts, algbw, limiting):
    topo, text = imported("dgx-a100.txt", gpu="a100", hosts=hosts, nic_bandwidth=200e9 / 8, nics=COMPUTE_NICS)
    zoo = Topology.load(os.path.join(ROOT, "topologies", f"dgx-a100-{hosts}x8.yaml"))
    cut = bounds.cut_bound(topo)
    assert round(cut.algbw / GB, 2) == algbw and cut.ranks_in_cut == limiting
    assert cut.algbw == pytest.approx(bounds.cut_bound(zoo).algbw)
    assert bounds.allreduce_bound(topo).seconds_per_byte == pytest.approx(
        bounds.allreduce_bound(zoo).seconds_per_byte)
    assert topo.nranks == 8 * hosts and len(topo.hosts) == hosts
    graph = topo.usable_graph()
    assert graph["h1/gpu3"]["h1/nvswitch"]["capacity"] == 12 * 25 * GB     # NV12 on every pair: NVSwitch
    assert not any("mlx5_4" in v for v in graph)                           # storage NICs left out
    assert graph["h0/numa3"]["h0/smp"]["capacity"] == 38.4 * GB              # 4 NUMA nodes: one switch


def test_boxes_that_share_their_nvswitches():
    """--nvlink-domain: two boxes on one NVLink fabric (multi-node NVLink) plan as one NVSwitch of 16."""
    topo, text = imported("dgx-a100.txt", gpu="a100", hosts=2, nic_bandwidth=200e9 / 8, nics=COMPUTE_NICS,
                          nvlink_domain=2)
    graph = topo.usable_graph()
    assert graph["h1/gpu3"]["nvlink0"]["capacity"] == 12 * 25 * GB and "h0/nvswitch" not in graph
    assert topo.route_bandwidth(0, 8) == 12 * 25 * GB
    assert "NVLink domains of 2 hosts" in text.replace("\n#   ", " ")
    with pytest.raises(TopologyError, match="this machine's GPUs have none"):
        imported("pcie-8gpu.txt", gpu="h100", hosts=2, nic_bandwidth=25 * GB, nvlink_domain=2)


def test_all_nics_of_a_box_unless_picked():
    topo, _ = imported("dgx-a100.txt", gpu="a100", hosts=2, nic_bandwidth=25 * GB)
    assert sum(1 for v in topo.nodes if topo.kind(v) == "nic") == 2 * 10


def test_pcie_tree_from_switches_trees_and_sockets():
    """Two GPUs per switch, two switches per tree (PXB), one tree per socket; the NIC shares the first
    switch. The largest group's switch is the tree's root; the other pair shares its own uplink."""
    topo, _ = imported("pcie-8gpu.txt", gpu="a100")
    want = {("h0/cpu0", "h0/pcie0", 25), ("h0/gpu0", "h0/pcie0", 25), ("h0/gpu1", "h0/pcie0", 25),
            ("h0/pcie0", "h0/pcie1", 25), ("h0/gpu2", "h0/pcie1", 25), ("h0/gpu3", "h0/pcie1", 25),
            ("h0/cpu1", "h0/pcie2", 25), ("h0/gpu4", "h0/pcie2", 25), ("h0/gpu5", "h0/pcie2", 25),
            ("h0/pcie2", "h0/pcie3", 25), ("h0/gpu6", "h0/pcie3", 25), ("h0/gpu7", "h0/pcie3", 25),
            ("h0/cpu0", "h0/cpu1", 38.4)}
    assert edges(topo) == want
    fragment, _ = imported("pcie-8gpu.txt", gpu="a100", gpus=[2, 3, 6], cpu_link=10 * GB)
    assert list(fragment.ranks) == ["h0/gpu2", "h0/gpu3", "h0/gpu6"]
    assert ("h0/cpu0", "h0/cpu1", 10) in edges(fragment)
    assert not any(v.startswith("h0/gpu0") for v in fragment.nodes)      # GPUs outside the job are left out


def test_nvlink_pairs_without_a_switch():
    """A 4-GPU board with 4 NVLinks between every pair (12 per GPU) is a mesh, not an NVSwitch. Asked
    for, an NVSwitch takes NV# links from each GPU: what nvidia-smi shows on a switched system, where
    every pair can use all of a GPU's links."""
    text = "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n" + "".join(
        f"GPU{i}\t" + "\t".join(" X " if i == j else "NV4" for j in range(4)) + "\t0-31\t0\n" for i in range(4))
    m = nvidia_smi.read_matrix(text, "hgx4")
    mesh = Topology.from_dict(yaml.safe_load(nvidia_smi.topology(m, "hgx4", gpu="a100")))
    assert ("h0/gpu0", "h0/gpu3", 100) in edges(mesh) and "h0/nvswitch" not in mesh.nodes
    switched = Topology.from_dict(yaml.safe_load(nvidia_smi.topology(m, "hgx4", gpu="a100", nvswitch="yes")))
    assert ("h0/gpu0", "h0/nvswitch", 100) in edges(switched)
    assert sum(c for u, v, c in edges(mesh) if "h0/gpu0" in (u, v) and "gpu" in u and "gpu" in v) == 300


def test_what_a_terminal_does_to_the_matrix_is_read_alike():
    """Tabs copied from a terminal as spaces, CRLF line ends, a prompt line above, SOC for SYS."""
    with open(os.path.join(HERE, "nvidia_smi", "pcie-8gpu.txt"), encoding="utf-8") as f:
        text = f.read()
    pasted = "$ nvidia-smi topo -m\r\n" + text.replace("\t", "    ").replace("SYS", "SOC").replace("\n", "\r\n")
    a = nvidia_smi.read_matrix(text, "a")
    b = nvidia_smi.read_matrix(pasted, "b")
    assert a.devices == b.devices and a.cpus == b.cpus
    assert {k: nvidia_smi.PATH_LEVELS[v] for k, v in a.paths.items()} == \
        {k: nvidia_smi.PATH_LEVELS[v] for k, v in b.paths.items()}


def test_affinity_columns_and_legend():
    m = matrix("dgx-a100.txt")
    assert m.numa["GPU0"] == 3 and m.numa["GPU7"] == 5 and "NIC0" not in m.numa
    assert m.cpus["GPU2"] == "16-31,144-159"
    assert m.names["NIC9"] == "mlx5_9"


@pytest.mark.parametrize("edit, words", [
    (lambda t: "nothing to see\n", ["not the output of `nvidia-smi topo -m`"]),
    (lambda t: t.replace("GPU3\tNV1\tNV2\tNV2", "GPU3\tNV1\tNV2\tNVX", 1), ["row GPU3, column GPU2", "'NVX'"]),
    (lambda t: t.replace("GPU3\tNV1\tNV2\tNV2", "GPU3\tNV1\tNV2\tNV999", 1), ["row GPU3, column GPU2", "NV999 bonds 999",
                                                                           "at most 18"]),
    (lambda t: t.replace("GPU5\tSYS\tNV1", "GPU5\tSYS\tNV2", 1), ["row GPU1 says NV1 to GPU5", "GPU5 says NV2"]),
    (lambda t: "".join(line for line in t.splitlines(True) if not line.startswith("NIC2")), ["no row for NIC2"]),
    (lambda t: t.replace("NIC3\tSYS\tSYS\tSYS\tSYS\tPHB", "NIC3\tSYS\tSYS", 1), ["row NIC3 has 9 entries for 12 columns"]),
    (lambda t: t.replace("GPU4\tNV2", "GPU4\t X ", 1), ["row GPU4, column GPU0", "'X'"]),
])
def test_a_damaged_matrix_is_named(edit, words):
    with open(os.path.join(HERE, "nvidia_smi", "dgx1-v100.txt"), encoding="utf-8") as f:
        text = edit(f.read())
    with pytest.raises(TopologyError) as err:
        nvidia_smi.read_matrix(text, "m.txt")
    assert str(err.value).startswith("m.txt: ")
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("options, words", [
    ({}, ["how fast NVLink and PCIe are", "--gpu"]),
    ({"nvlink": 25 * GB}, ["how fast PCIe is", "--pcie 25GB/s"]),
    ({"gpu": "a100", "hosts": 2}, ["2 hosts", "--nic-bandwidth"]),
    ({"gpu": "a100", "gpus": [0, 8]}, ["--gpus: the machine has no GPU 8", "0, 1, 2"]),
    ({"gpu": "a100", "nic_bandwidth": GB, "nics": ["mlx5_0", "eth0"]}, ["no NIC eth0", "NIC4 (mlx5_4)"]),
    ({"gpu": "x100"}, ["unknown GPU 'x100'", "h100"]),
    ({"gpu": "a100", "nvswitch": "yes", "gpus": [0, 1]}, []),      # every pair shows NV12: allowed
])
def test_what_the_matrix_cannot_say_is_asked_for(options, words):
    if not words:
        nvidia_smi.topology(matrix("dgx-a100.txt"), "x", **options)
        return
    with pytest.raises(TopologyError) as err:
        nvidia_smi.topology(matrix("dgx-a100.txt"), "x", **options)
    for w in words:
        assert w in str(err.value)


def test_nvswitch_needs_uniform_links():
    with pytest.raises(TopologyError, match="same NV#"):
        nvidia_smi.topology(matrix("dgx1-v100.txt"), "x", gpu="v100", nvswitch="yes")


def test_a_host_without_nics_cannot_be_joined():
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPHB\t0-7\nGPU1\tPHB\t X \t0-7\n"
    m = nvidia_smi.read_matrix(text, "ws")
    with pytest.raises(TopologyError, match="the matrix lists none"):
        nvidia_smi.topology(m, "ws", gpu="a100", hosts=2, nic_bandwidth=GB)
    one = Topology.from_dict(yaml.safe_load(nvidia_smi.topology(m, "ws", gpu="a100")))
    assert edges(one) == {("h0/cpu0", "h0/gpu0", 25), ("h0/cpu0", "h0/gpu1", 25)}


def ddl(*args, stdin=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "ddl", *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_cli_writes_a_file_that_verifies_a_plan(tmp_path):
    out = tmp_path / "cluster.yaml"
    r = ddl("topo", "import", os.path.join(HERE, "nvidia_smi", "dgx-a100.txt"), "--gpu", "a100", "--hosts", "2",
            "--nic-bandwidth", "200Gbit/s", "--nics", ",".join(COMPUTE_NICS), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "16 ranks on 2 hosts" in r.stderr and r.stdout == ""
    topo = Topology.load(out)
    assert topo.name == "cluster" and round(bounds.cut_bound(topo).algbw / GB, 2) == 346.67
    verify(hierarchical(topo, "allreduce", nbytes=64 << 20))       # the planners take it as it is


def test_cli_reads_standard_input_and_says_mistakes_in_one_line(tmp_path):
    with open(os.path.join(HERE, "nvidia_smi", "pcie-8gpu.txt"), encoding="utf-8") as f:
        text = f.read()
    r = ddl("topo", "import", "-", "--gpu", "h100", "--name", "box", stdin=text)
    assert r.returncode == 0, r.stderr
    assert Topology.from_dict(yaml.safe_load(r.stdout)).name == "box"
    for args, words in [(["-"], "how fast PCIe is"), (["-", "--gpu", "a100", "--hosts", "3"], "--nic-bandwidth"),
                        (["missing.txt", "--gpu", "a100"], "missing.txt"),
                        (["-", "--gpu", "a100", "--pcie", "0GB/s"], "positive bandwidth"),
                        (["-", "--gpu", "a100", "--hosts", "3", "--nic-bandwidth", "25GB/s", "--nvlink-domain", "2"],
                         "--nvlink-domain 2 must divide --hosts 3")]:
        r = ddl("topo", "import", *args, stdin=text, cwd=tmp_path)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 or "usage:" in r.stderr


@pytest.mark.parametrize("name", ["dgx1-v100.txt", "pcie-8gpu.txt"])
def test_a_matrix_given_as_a_topology_file_points_to_the_import(name):
    from ddl.nvidia_smi import GPU_PRESETS
    assert set(GPU_PRESETS) == {"p100", "v100", "a100", "h100", "b200"}   # the models the message lists
    with pytest.raises(TopologyError, match=r"output of `nvidia-smi topo -m`, not a topology file: make one from "
                                            r"it with `ddl topo import FILE --gpu MODEL -o cluster.yaml`, MODEL "
                                            r"being your GPUs' \(p100, v100, a100, h100 or b200"):
        Topology.load(os.path.join(HERE, "nvidia_smi", name))

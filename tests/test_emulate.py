"""Tests of ddl.emulate: the topology -> network mapping (no root needed) and, as root with iproute2,
a real two-host cluster: built, self-checked, used for an MPI Allreduce, torn down without a trace."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from ddl import Error
from ddl.emulate import launch, netns
from ddl.emulate.netns import Cluster, plan_network
from ddl.topology import Topology

MBIT = 1e6 / 8


def two_rack(interleaved=False):
    """4 hosts x 2 ranks, hosts 0-1 on rack0 and 2-3 on rack1, 400 Mbit/s NICs, 100 Mbit/s uplinks."""
    nodes = [("spine", "switch"), ("rack0", "switch"), ("rack1", "switch")]
    links = [{"a": f"rack{r}", "b": "spine", "bandwidth": 100 * MBIT} for r in range(2)]
    for h in range(4):
        nodes += [(f"h{h}", "host"), (f"h{h}/cpu0", "cpu"), (f"h{h}/cpu1", "cpu")]
        links += [{"a": f"h{h}/cpu{c}", "b": f"h{h}", "bandwidth": 5e9} for c in range(2)]
        links.append({"a": f"h{h}", "b": f"rack{h // 2}", "bandwidth": 400 * MBIT})
    order = (0, 2, 1, 3) if interleaved else (0, 1, 2, 3)
    return Topology("two-rack", nodes, links, [f"h{h}/cpu{c}" for h in order for c in range(2)])


def small(name, hosts=2, per_host=2, rate=200 * MBIT):
    """``hosts`` hosts with ``per_host`` ranks each, on one switch."""
    nodes, links, ranks = [("sw", "switch")], [], []
    for h in range(hosts):
        nodes.append((f"n{h}", "host"))
        links.append({"a": f"n{h}", "b": "sw", "bandwidth": rate})
        for c in range(per_host):
            nodes.append((f"n{h}/cpu{c}", "cpu"))
            links.append({"a": f"n{h}/cpu{c}", "b": f"n{h}", "bandwidth": 5e9})
            ranks.append(f"n{h}/cpu{c}")
    return Topology(name, nodes, links, ranks)


# ------------------------------------------------------------------------------------ mapping, no root

def test_two_rack_mapping():
    plan = plan_network(two_rack(), "ddl-7")
    assert [h.netns for h in plan.hosts] == [f"ddl-7-h{i}" for i in range(4)]
    assert [h.address for h in plan.hosts] == [f"198.18.0.{10 + i}" for i in range(4)]
    assert [h.switch for h in plan.hosts] == ["rack0", "rack0", "rack1", "rack1"]
    assert [h.ranks for h in plan.hosts] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(h.rate_out == h.rate_in == 400 * MBIT for h in plan.hosts)
    assert set(plan.bridges) == {"spine", "rack0", "rack1"}
    assert {(u.a, u.b) for u in plan.uplinks} == {("spine", "rack0"), ("spine", "rack1")}
    assert all(u.rate_ab == u.rate_ba == 100 * MBIT for u in plan.uplinks)
    assert plan.path_rate("h0", "h1") == 400 * MBIT
    assert plan.path_rate("h0", "h3") == 100 * MBIT
    assert plan.namespaces[-1] == "ddl-7-sw"
    again = netns.NetworkPlan.from_dict(plan.to_dict())
    assert again == plan


def test_frame_size_and_goodput():
    assert plan_network(two_rack(), "ddl-7").mtu == 1500
    plan = plan_network(two_rack(), "ddl-7", mtu="9000")
    assert plan.mtu == 9000 and netns.NetworkPlan.from_dict(plan.to_dict()) == plan
    assert netns.goodput(1500) == pytest.approx(0.956, abs=1e-3)     # as measured over tbf
    assert netns.goodput(9000) == pytest.approx(0.993, abs=1e-3)
    for bad in (576, 65536, "jumbo", 9000.5):
        with pytest.raises(Error, match="--mtu must be a whole number of bytes from 1280 to 65535"):
            plan_network(two_rack(), "ddl-7", mtu=bad)


def test_interleaved_ranks_and_hydra_hosts():
    topo = two_rack(interleaved=True)
    plan = plan_network(topo, "ddl-7")
    assert plan.host("h2").ranks == (2, 3)
    hosts, exact = launch.hydra_hostlist(plan, launch.rank_hosts(topo))
    assert exact and hosts == "198.18.0.10:2,198.18.0.12:2,198.18.0.11:2,198.18.0.13:2"


def test_hydra_hostlist_round_robin_and_irregular():
    plan = plan_network(two_rack(), "ddl-7")
    assert launch.hydra_hostlist(plan, ["h0", "h1", "h0", "h1"]) == ("198.18.0.10:1,198.18.0.11:1", True)
    hosts, exact = launch.hydra_hostlist(plan, ["h0", "h1", "h0", "h0"])
    assert not exact and hosts == "198.18.0.10:1,198.18.0.11:1,198.18.0.10:2"


class _Unbuilt:
    """What :func:`launch.mpiexec_argv` reads of a cluster, without building one (no root needed)."""

    def __init__(self, topo, state_dir):
        self.plan, self.state_dir = plan_network(topo, "ddl-7"), state_dir

    def host_argv(self, host, argv):
        return list(argv)


def _genv(argv):
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}


def test_a_job_larger_than_the_machine_is_told_it_is_oversubscribed(tmp_path, monkeypatch):
    """Each rank sees only its emulated host's ranks as its node; the launcher knows they all share this
    machine's cores, and says so when the job outnumbers them (unless the user has)."""
    topo = two_rack()
    cluster, placement = _Unbuilt(topo, tmp_path), launch.rank_hosts(topo)
    monkeypatch.delenv("DDL_OVERSUBSCRIBED", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    env = _genv(launch.mpiexec_argv(cluster, ["prog"], placement))
    assert env["DDL_OVERSUBSCRIBED"] == "1" and env["DDL_EMULATED_HOSTS"] == "h0,h0,h1,h1,h2,h2,h3,h3"
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert "DDL_OVERSUBSCRIBED" not in _genv(launch.mpiexec_argv(cluster, ["prog"], placement))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("DDL_OVERSUBSCRIBED", "0")        # the user's word stands (hydra passes it on)
    assert "DDL_OVERSUBSCRIBED" not in _genv(launch.mpiexec_argv(cluster, ["prog"], placement))
    assert _genv(launch.mpiexec_argv(cluster, ["prog"], placement, env={"X": "1"}))["X"] == "1"


def test_nic_chain_bottleneck_and_hostname():
    topo = Topology("chain", [("sw", "switch"), ("r0/h0", "host"), ("r0/h0/nic", "nic"),
                              ("r0/h0/gpu0", "gpu"), ("b", "host"), ("b/gpu0", "gpu")],
                    [{"a": "r0/h0/gpu0", "b": "r0/h0", "bandwidth": 16e9},
                     {"a": "r0/h0", "b": "r0/h0/nic", "bandwidth": 10 * MBIT},
                     {"a": "r0/h0/nic", "b": "sw", "bandwidth": 100 * MBIT},
                     {"a": "b/gpu0", "b": "b", "bandwidth": 16e9},
                     {"a": "b", "b": "sw", "bandwidth": 50 * MBIT, "count": 2}],
                    ["r0/h0/gpu0", "b/gpu0"])
    plan = plan_network(topo, "ddl-7")
    a, b = plan.hosts
    assert (a.hostname, a.rate_out, a.rate_in) == ("r0-h0", 10 * MBIT, 10 * MBIT)
    assert b.rate_out == 100 * MBIT           # two parallel links add up
    assert not plan.uplinks and list(plan.bridges) == ["sw"]
    assert plan_network(topo, "x", scale=0.5).host("b").rate_in == 50 * MBIT
    # a scale that leaves no rate tc can shape is a user error, not an OverflowError from rounding
    for scale in (float("inf"), 1e300, 1e12):
        with pytest.raises(Error, match="scale"):
            plan_network(topo, "x", scale=scale)
    assert plan_network(topo, "x", scale=1e6).host("b").rate_in == pytest.approx(100e6 * MBIT)


def test_host_addresses_extend_beyond_one_block():
    assert netns.host_address(0) == "198.18.0.10"
    assert netns.host_address(239) == "198.18.0.249"
    assert netns.host_address(240) == "198.18.1.10"
    assert netns.host_address(256 * 240) == "198.19.0.10"


@pytest.mark.parametrize("nodes, links, ranks, words", [
    ([("sw", "switch"), ("g", "gpu")], [{"a": "g", "b": "sw", "bandwidth": 1e9}], ["g"], "no node of kind 'host'"),
    ([("a", "host"), ("b", "host"), ("a/g", "gpu"), ("b/g", "gpu")],
     [{"a": "a", "b": "b", "bandwidth": 1e9}, {"a": "a/g", "b": "a", "bandwidth": 1e9},
      {"a": "b/g", "b": "b", "bandwidth": 1e9}], ["a/g", "b/g"], "without a switch"),
    ([("s0", "switch"), ("s1", "switch"), ("s2", "switch"), ("a", "host"), ("a/g", "gpu")],
     [{"a": "s0", "b": "s1", "bandwidth": 1e9}, {"a": "s1", "b": "s2", "bandwidth": 1e9},
      {"a": "s2", "b": "s0", "bandwidth": 1e9}, {"a": "a", "b": "s0", "bandwidth": 1e9},
      {"a": "a/g", "b": "a", "bandwidth": 1e9}], ["a/g"], "loop"),
    ([("s0", "switch"), ("s1", "switch"), ("a", "host"), ("a/g", "gpu")],
     [{"a": "a", "b": "s0", "bandwidth": 1e9}, {"a": "a", "b": "s1", "bandwidth": 1e9},
      {"a": "a/g", "b": "a", "bandwidth": 1e9}], ["a/g"], "reaches 2 switches"),
])
def test_refusals(nodes, links, ranks, words):
    with pytest.raises(Error, match=words):
        plan_network(Topology("bad", nodes, links, ranks), "ddl-7")


def test_single_host_needs_no_switch():
    topo = Topology("one", [("h", "host"), ("h/g0", "gpu"), ("h/g1", "gpu")],
                    [{"a": "h/g0", "b": "h/g1", "bandwidth": 1e9}], ["h/g0", "h/g1"])
    plan = plan_network(topo, "ddl-7")
    assert plan.hosts[0].switch is None and not plan.bridges and plan.namespaces == ("ddl-7-h0",)


def test_cli_refuses_without_root_or_tools(monkeypatch, tmp_path, capsys):
    from ddl.cli import main
    path = tmp_path / "small.json"
    small("cli").dump(path)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["emulate", "up", str(path)]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else "/bin/" + name)
    assert main(["emulate", "run", str(path), "--", "true"]) == 2
    assert "needs tc" in capsys.readouterr().err


# ------------------------------------------------------------------------------- a real cluster, root

def _skip_reason():
    if os.geteuid() != 0:
        return "emulation needs root (network namespaces)"
    missing = [t for t in netns.REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        return f"emulation needs {', '.join(missing)} on PATH"
    try:
        launch.find_mpiexec()
    except Error as exc:
        return str(exc)
    return None


needs_root = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

ALLREDUCE = textwrap.dedent("""
    import os, socket
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    assert socket.gethostname() == os.environ["DDL_EMULATED_HOSTS"].split(",")[comm.rank]
    n = 1 << 20
    x = np.arange(n, dtype=np.float64) * (comm.rank + 1)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    expected = np.sum([np.arange(n, dtype=np.float64) * (r + 1) for r in range(comm.size)], axis=0)
    assert np.array_equal(y, expected)
    names = comm.gather(socket.gethostname())
    if comm.rank == 0:
        print("ALLREDUCE-OK", ",".join(names), flush=True)
        print("OVERSUBSCRIBED", os.environ.get("DDL_OVERSUBSCRIBED"), flush=True)
""")


def _leftovers(tag, state_dir):
    spaces = [ns for ns in netns.list_namespaces() if ns.startswith(tag + "-")]
    return spaces, state_dir.exists()


@needs_root
@pytest.mark.timeout(120)
def test_cluster_selfcheck_allreduce_teardown(tmp_path):
    from ddl.emulate.selfcheck import SAME_HOST, selfcheck
    topo = small(f"ddl-test-{os.getpid()}")
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    cluster = Cluster.create(topo, mtu=9000)
    try:
        tag, state = cluster.plan.tag, cluster.state_dir
        assert len(_leftovers(tag, state)[0]) == 3
        host = subprocess.run(cluster.host_argv("n1", ["hostname"]), capture_output=True, text=True,
                              timeout=10).stdout.strip()
        assert host == "n1"
        eth0 = subprocess.run(cluster.host_argv("n1", ["cat", "/sys/class/net/eth0/mtu"]), capture_output=True,
                              text=True, timeout=10).stdout.strip()
        assert eth0 == "9000"                  # and the self-check below finds the rates at that size
        checks = selfcheck(cluster, topo, timeout=60)
        assert [c.cls for c in checks] == [SAME_HOST, "same switch"] and all(c.ok for c in checks)
        res = launch.run(cluster, [sys.executable, str(script)], launch.rank_hosts(topo), timeout=60,
                         capture=True)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "ALLREDUCE-OK n0,n0,n1,n1" in res.stdout
        told = "1" if 4 > (os.cpu_count() or 1) else None
        assert f"OVERSUBSCRIBED {told}" in res.stdout or "DDL_OVERSUBSCRIBED" in os.environ
    finally:
        cluster.down()
    assert _leftovers(tag, state) == ([], False)


@needs_root
@pytest.mark.timeout(60)
def test_cli_run_tears_down_after_failure(tmp_path):
    from ddl.cli import main
    topo = small(f"ddl-test-cli-{os.getpid()}", per_host=1)
    path = tmp_path / "topo.json"
    topo.dump(path)
    before = set(netns.list_namespaces())
    rc = main(["emulate", "run", str(path), "--no-check", "--timeout", "30", "--",
               sys.executable, "-c", "import sys; from mpi4py import MPI; sys.exit(MPI.COMM_WORLD.rank + 3)"])
    assert rc != 0
    assert set(netns.list_namespaces()) <= before
    assert not netns.state_dir_for(topo.name).exists()

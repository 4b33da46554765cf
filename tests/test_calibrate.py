"""``ddl topo probe --write``: how measured figures become a corrected file (no MPI here; the runs on
emulated clusters are in test_emulate.py)."""
from pathlib import Path

import pytest

from ddl import probe
from ddl.calibrate import calibrated
from ddl.topology import Topology

from _fabrics import MBIT, two_rack_fabric

ZOO = Path(__file__).resolve().parents[1] / "topologies"


def two_racks(per_class=1):
    topo = Topology.load(ZOO / "emulated-2rack.yaml")
    return topo, probe.pair_classes(topo, per_class), probe.host_patterns(topo)


def measured(topo, classes, patterns, pair_scale=1.0, pattern_scale=1.0, reduce_rate=None):
    """Findings as if every pair between hosts ran at ``pair_scale`` of the file, every pattern's flows
    at ``pattern_scale`` (or per pattern, a list) and every rank reduced at ``reduce_rate`` (default: the file's)."""
    pairs = {pair: (c.rate * (1.0 if c.same_host else pair_scale), 1e-5) for c in classes for pair in c.pairs}
    scales = pattern_scale if isinstance(pattern_scale, list) else [pattern_scale] * len(patterns)
    timed = [probe.transfer_bytes(p.rate) / (p.rate * k) for p, k in zip(patterns, scales)]
    reduces = {r: reduce_rate or topo.reduce_bandwidth(r) for r in range(topo.nranks)}
    return probe.findings(topo, classes, pairs, reduces, 0.15, patterns, timed)


def rates(data):
    """{(a, b): bytes/s} of the written links."""
    fixed = Topology.from_dict(data)
    return {(link.a, link.b): link.bandwidth for link in fixed.links}


def test_a_slow_route_scales_the_links_that_bound_it_and_only_those():
    topo, classes, patterns = two_racks()
    data, changes, notes = calibrated(topo, measured(topo, classes, patterns, pair_scale=0.5, pattern_scale=0.5))
    fixed = Topology.from_dict(data, source="fixed.yaml")
    for c in classes:                                  # every measured route now carries what it measured
        for i, j in c.pairs:
            assert fixed.route_bandwidth(i, j) == pytest.approx(c.rate * (1 if c.same_host else 0.5), rel=1e-3)
    new = rates(data)
    assert new[("h0", "rack0")] == new[("h1", "rack0")] == pytest.approx(200 * MBIT, rel=1e-3)   # 0 -> 2 crossed these
    assert new[("rack0", "spine")] == new[("rack1", "spine")] == pytest.approx(50 * MBIT, rel=1e-3)  # ... 0 -> 4 these
    assert new[("h2", "rack1")] == 400 * MBIT          # on no measured route: as the file says
    assert new[("h0/cpu0", "h0")] == 5e9               # the same-host pair held
    assert len(changes) == 4 and changes[0].startswith("link h0 - rack0: 50 MB/s -> 25 MB/s (between hosts 0 -> 2")
    assert notes and all(n.startswith("not taken: all at once") for n in notes)   # pairs differed first
    assert "differed from" in data["description"] and topo.source in data["description"]


def test_more_pairs_per_class_reach_every_hosts_links():
    topo, classes, patterns = two_racks(per_class=4)
    data, changes, _ = calibrated(topo, measured(topo, classes, patterns, pair_scale=0.5, pattern_scale=0.5))
    assert all(rates(data)[(f"h{h}", f"rack{h // 2}")] == pytest.approx(200 * MBIT, rel=1e-3) for h in range(4))


def test_flows_at_once_scale_the_links_they_share_when_pairs_hold():
    """A file that says 400 Mbit/s uplinks where they carry 200: pairs alone and the flows to the
    next host hold (a NIC bounds each), the flows across the racks at once run at half. The uplinks
    become what those flows measured; the NICs, as loaded in that pattern but vindicated by the
    others, stay."""
    topo = two_rack_fabric(400 * MBIT, reduce_bandwidth="2 GB/s")
    classes, patterns = probe.pair_classes(topo), probe.host_patterns(topo)
    found = measured(topo, classes, patterns, pattern_scale=[1.0, 0.5])
    near, across = [f for f in found if f.what == "pattern"]
    assert near.ok and not across.ok
    assert {(u, v) for u, v, *_ in across.bottleneck} >= {("h0", "rack0"), ("rack0", "spine")}   # tied
    data, changes, notes = calibrated(topo, found)
    new = rates(data)
    assert new[("rack0", "spine")] == new[("rack1", "spine")] == pytest.approx(200 * MBIT, rel=1e-3)
    assert all(new[(f"h{h}", f"rack{h // 2}")] == 200 * MBIT for h in range(4)) and not notes
    assert len(changes) == 2 and all("per flow" in line for line in changes)


def test_flows_at_once_wait_while_pairs_differ():
    topo = two_rack_fabric(400 * MBIT, reduce_bandwidth="2 GB/s")
    classes, patterns = probe.pair_classes(topo), probe.host_patterns(topo)
    data, changes, notes = calibrated(topo, measured(topo, classes, patterns, pair_scale=0.5, pattern_scale=0.5))
    assert rates(data)[("rack0", "spine")] == 400 * MBIT                # not from the patterns this pass
    assert len(notes) == 2 and all("probe the written file again" in n for n in notes)


def test_slow_reductions_set_the_hosts_ranks_reduce_bandwidth():
    topo, classes, patterns = two_racks()
    data, changes, _ = calibrated(topo, measured(topo, classes, patterns, reduce_rate=1e9))
    fixed = Topology.from_dict(data)
    assert [fixed.reduce_bandwidth(r) for r in range(topo.nranks)] == [1e9] * topo.nranks
    assert len(changes) == 4 and all(line.startswith("reduce_bandwidth of host h") for line in changes)


def test_nothing_differs_nothing_changes():
    topo, classes, patterns = two_racks()
    data, changes, notes = calibrated(topo, measured(topo, classes, patterns, pair_scale=1.1, reduce_rate=2.2e9))
    assert changes == [] and notes == []
    del data["description"]                            # the one addition: what was measured
    assert data == topo.to_dict()


def test_a_faster_fabric_scales_up_parallel_links_alike():
    """Two parallel 10 GB/s links between the hosts, measured at 30 GB/s: each becomes 15 GB/s."""
    nodes = [("a", "host"), ("a/cpu0", "cpu"), ("b", "host"), ("b/cpu0", "cpu")]
    links = [{"a": "a/cpu0", "b": "a", "bandwidth": "100 GB/s"}, {"a": "b/cpu0", "b": "b", "bandwidth": "100 GB/s"},
             {"a": "a", "b": "b", "bandwidth": "10 GB/s", "count": 2}]
    topo = Topology("pair", nodes, links, ["a/cpu0", "b/cpu0"], {"reduce_bandwidth": "2 GB/s"}, source="pair.yaml")
    classes = probe.pair_classes(topo)
    found = measured(topo, classes, [], pair_scale=1.5)
    data, changes, _ = calibrated(topo, found)
    assert rates(data)[("a", "b")] == pytest.approx(15e9, rel=1e-3) and len(changes) == 1
    assert Topology.from_dict(data).route_bandwidth(0, 1) == pytest.approx(30e9, rel=1e-3)


def test_a_guessed_file_gets_each_tier_from_the_pair_that_measures_it():
    """A file of the right shape whose NICs and uplinks all say a guessed 1 GB/s, on the racks of
    emulated-2rack (50 MB/s NICs, 12.5 MB/s uplinks): the pair across the racks is bounded in the
    file by its NICs and the uplinks alike, but its NICs carried 50 MB/s for the pairs within a rack,
    so only the uplinks take its 12.5 MB/s."""
    real = Topology.load(ZOO / "emulated-2rack.yaml")
    shape = real.to_dict()
    for link in shape["links"]:
        if "cpu" not in link["a"]:
            link["bandwidth"] = "1 GB/s"
    guess = Topology.from_dict(shape, source="guess.yaml")
    classes, patterns = probe.pair_classes(guess, per_class=4), probe.host_patterns(guess)
    pairs = {(i, j): (real.route_bandwidth(i, j), 1e-5) for c in classes for i, j in c.pairs}
    timed = [probe.transfer_bytes(p.rate) / p.rate for p in patterns]
    found = probe.findings(guess, classes, pairs, {r: 2e9 for r in range(8)}, 0.15, patterns, timed)
    data, changes, notes = calibrated(guess, found)
    assert rates(data) == pytest.approx({(link.a, link.b): link.bandwidth for link in real.links}, rel=1e-3)
    assert len(changes) == 6

"""delegated: slow hosts reduce at home, upload through one relay each, and take the result back."""
from pathlib import Path

import pytest

from ddl.algorithms import ALGORITHMS, delegated_schedule, ring_schedule
from ddl.algorithms.delegated import (MAX_PIECES, PIECE_BYTES, RAMP_CHUNKS, RAMP_PIECE_BYTES, core_facts,
                                      cut_chunks, slow_hosts)
from ddl.bounds import lower_bound
from ddl.errors import PlanError
from ddl.schedule import RECV, REDUCE, SEND
from ddl.simulate import link_totals, simulate
from ddl.topology import Topology
from ddl.verify import verify
from test_algorithms import hosts_behind_switch as cluster

ZOO = Path(__file__).resolve().parent.parent / "topologies"
GB = 1e9


def test_the_slow_hosts_of_the_heterogeneous_cluster():
    topo = Topology.load(ZOO / "hetero-cluster.yaml")
    bandwidths = topo.host_bandwidths
    assert bandwidths["t0"] == bandwidths["t1"] == pytest.approx(3.125 * GB)        # one 25 Gbit/s NIC
    assert bandwidths["v0"] == bandwidths["a1"] == pytest.approx(50 * GB)          # 4 x 100, 2 x 200 Gbit/s
    slow, core = slow_hosts(topo)
    assert slow == [tuple(range(24, 28)), tuple(range(28, 32))] and core == tuple(range(24))


def test_it_declines_where_no_host_is_slow_or_the_core_is_one_rank():
    with pytest.raises(PlanError, match="no host's links are 2x slower"):
        ALGORITHMS["delegated"](cluster([4, 4, 2], [10, 10, 6]), "allreduce")
    with pytest.raises(PlanError, match="at least 2 must form the core"):
        ALGORITHMS["delegated"](cluster([1, 4], [10, 1]), "allreduce")
    with pytest.raises(PlanError, match="needs two hosts or more"):
        ALGORITHMS["delegated"](Topology.load(ZOO / "fat-tree-4x4-r4.yaml"), "allreduce")
    with pytest.raises(PlanError, match="does not support 'allgather'"):
        ALGORITHMS["delegated"](cluster([4, 2], [10, 1]), "allgather")


@pytest.mark.parametrize("nbytes", [None, 4096, 64 << 20])
def test_slow_hosts_move_the_bound_bytes_each_way_and_upload_to_one_rank(nbytes):
    # what a slow host's link carries is its sum out and the result in, the whole buffer each way: the
    # cut bound's bytes, no more; and each of its ranks sends out of the host to one core rank only
    topo = cluster([4, 4, 3, 1], [100, 100, 5, 5])
    sched = ALGORITHMS["delegated"](topo, "allreduce", nbytes=nbytes)
    verify(sched)
    assert sched.info["slow_hosts"] == [[8, 9, 10], [11]] and sched.info["core"] == list(range(8))
    n = nbytes or 1 << 20
    loads = link_totals(topo, sched, n)
    for host in ("h2", "h3"):
        assert loads[(host, "sw")] == pytest.approx(n) and loads[("sw", host)] == pytest.approx(n)
    for rank in range(8, 12):
        out = {peer for kind, _, peer in sched.programs[rank] if kind == SEND and peer < 8}
        assert len(out) <= 1, f"rank {rank} uploads to {out}"
    if nbytes == 4096:          # latency-bound: the first base alone, not simulated
        assert sched.info["core_algorithm"] == "hierarchical" and "variants_tried" not in sched.info
    if nbytes == 64 << 20:      # both bases tried, the faster composition kept
        # (one stopped once it provably could not win says how slow it is at least)
        tried = {v["core_algorithm"]: v["seconds"] if v["seconds"] is not None else v["at_least"]
                 for v in sched.info["variants_tried"]}
        assert set(tried) == {"tree-packing", "hierarchical"} and sched.info["core_algorithm"] == min(tried, key=tried.get)
        assert simulate(topo, sched, n).seconds == pytest.approx(min(tried.values()))
        assert min(tried.values()) <= 1.02 * lower_bound(topo, "allreduce", n).seconds


def test_the_builder_relays_through_the_delegate_while_its_copy_is_free():
    # a ring core of 3: every rank sends its part of a chunk, then receives the result, except the
    # chunk's target; uploads go through the delegate, or straight to the target where it is one
    base = ring_schedule([0, 1, 2], "allreduce", 2)
    targets, free = core_facts(base)
    for c, (rank, index) in targets.items():
        assert base.programs[rank][index][:2] == (REDUCE, c)
        assert c not in free[rank]
        assert all(c in free[r] and base.programs[r][free[r][c]][:2] == (RECV, c) for r in range(3) if r != rank)
    sched = delegated_schedule(base, [0, 1, 2], [[3, 4]], [[0, 1]])
    verify(sched)
    for owner, delegate in ((3, 0), (4, 1)):
        uploads = [op for op in sched.programs[owner] if op.kind == SEND and op.peer < 3]
        assert uploads and {op.peer for op in uploads} == {delegate}
        program = sched.programs[delegate]
        for _, c, _ in uploads:
            target = targets[c][0]
            if target == delegate:
                assert (REDUCE, c, owner) in program
            else:
                i = program.index((RECV, c, owner))
                assert program[i + 1] == (SEND, c, target) and (REDUCE, c, delegate) in sched.programs[target]


def test_pieces_keep_the_slow_side_messages_large_and_cut_the_ends_finer():
    topo = Topology.load(ZOO / "hetero-cluster.yaml")
    n = 256 << 20
    sched = ALGORITHMS["delegated"](topo, "allreduce", nbytes=n, bases=("hierarchical",))
    assert sched.info["core_algorithm"] == "hierarchical" and 0 < sched.info["ramp_chunks"] <= 2 * RAMP_CHUNKS
    sizes = sched.chunk_fractions * n
    uploads = [op.chunk for rank in range(24, 32) for op in sched.programs[rank] if op.kind == SEND and op.peer < 24]
    assert all(c < sched.nchunks for c in uploads)          # one piece per message, never a span
    assert min(sizes[uploads]) >= RAMP_PIECE_BYTES
    assert sum(sizes[uploads] < PIECE_BYTES) <= 2 * RAMP_CHUNKS * MAX_PIECES * 2   # the ends only, two hosts
    assert any(op.chunk >= sched.nchunks for op in sched.programs[0])      # the core moves cut chunks whole


def test_cut_chunks_keeps_the_schedule_and_moves_a_cut_chunk_in_one_message():
    base = ring_schedule([0, 1, 2, 3], "allreduce", 2)
    pieces = [1, 2, 4, 8, 1, 2, 8, 1]
    cut, split = cut_chunks(base, pieces, ramp={3})
    verify(cut)
    assert cut.nops == base.nops + 7 * sum(op.chunk == 3 for program in base.programs for op in program)
    assert [len(split[c]) for c in range(8)] == pieces
    for c in range(8):       # a cut chunk covers the same bytes, in equal pieces
        assert sum(cut.chunk_fraction(x) for x in split[c]) == pytest.approx(base.chunk_fraction(c))
        assert len({cut.chunk_fraction(x) for x in split[c]}) == 1


def test_known_answer_heterogeneous_cluster_within_one_percent_of_the_bound():
    # tree packing's core, the T4 hosts delegating: 1.007 of the bound at 256 MiB (tree packing alone 1.029)
    topo = Topology.load(ZOO / "hetero-cluster.yaml")
    n = 256 << 20
    sched = ALGORITHMS["delegated"](topo, "allreduce", nbytes=n, bases=("tree-packing",))
    verify(sched)
    assert simulate(topo, sched, n).seconds <= 1.01 * lower_bound(topo, "allreduce", n).seconds


def test_the_core_keeps_the_paths_its_plan_pinned_under_the_ranks_it_runs_on():
    # a slow host first: the core's positions 0..7 are ranks 2..9, and tree packing pins its routes
    topo = cluster([2, 4, 4], [5, 100, 100])
    sched = ALGORITHMS["delegated"](topo, "allreduce", nbytes=64 << 20, bases=("tree-packing",))
    verify(sched)
    assert sched.info["core"] == list(range(2, 10)) and sched.info["slow_hosts"] == [[0, 1]]
    core_topo = topo.with_ranks(topo.ranks[2:])
    base = ALGORITHMS["tree-packing"](core_topo, "allreduce", nbytes=64 << 20)
    assert base.routes and sched.routes == {(a + 2, b + 2): paths for (a, b), paths in base.routes.items()}
    simulate(topo, sched, 64 << 20)        # every pinned path runs between the ranks it is pinned for


def test_a_slow_rank_that_joins_two_switches_forwards_nothing():
    """The core is planned where the slow ranks are no ranks, so its pinned routes may pass through a slow
    host (here h4, joined to both switches, a wider way between them than their own link): a rank forwards
    nothing, and the composed schedule once failed its own check ("passes through 'h4', which does not
    forward data"). Such pairs take the topology's routes."""
    topo = Topology.from_dict({"name": "dualhomed", "nodes": [
        {"id": "sw0", "kind": "switch"}, {"id": "sw1", "kind": "switch"}, {"id": "h{i}", "kind": "host", "for": {"i": 5}}],
        "links": [{"a": "h{i}", "b": "sw0", "bandwidth": "100 GB/s", "for": {"i": [0, 1]}},
                  {"a": "h{i}", "b": "sw1", "bandwidth": "100 GB/s", "for": {"i": [2, 3]}},
                  {"a": "sw0", "b": "sw1", "bandwidth": "1 GB/s"},
                  {"a": "h4", "b": "sw0", "bandwidth": "10 GB/s"}, {"a": "h4", "b": "sw1", "bandwidth": "10 GB/s"}],
        "ranks": [{"id": "h{i}", "for": {"i": 5}}]})
    sched = ALGORITHMS["delegated"](topo, "allreduce", nbytes=64 << 20)
    verify(sched)
    assert sched.info["slow_hosts"] == [[4]]
    assert all("h4" not in path[1:-1] for paths in sched.routes.values() for path, _ in paths)
    assert simulate(topo, sched, 64 << 20).seconds >= lower_bound(topo, "allreduce", 64 << 20).seconds

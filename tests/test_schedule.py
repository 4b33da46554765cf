"""Schedule IR: chunk geometry, dependencies, matching, JSON, and the symbolic verifier."""
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddl.errors import ScheduleError
from ddl.schedule import Op, Schedule, ScheduleBuilder
from ddl.verify import check, verify


def ring_allreduce(p, k=1):
    """A plain ring (reduce-scatter then allgather), k pieces per ring block: the test's own reference."""
    b = ScheduleBuilder("allreduce", p, (1,) * (p * k), algorithm="test-ring")
    for phase, reduce in ((1, True), (0, False)):
        for t in range(p - 1):
            for i in range(p):
                block = (i - t - phase) % p
                for s in range(k):
                    b.transfer(i, (i + 1) % p, block * k + s, reduce=reduce)
    return b.build()


def star_allreduce(p):
    """Everyone reduces into rank 0, which sends the result back."""
    b = ScheduleBuilder("allreduce", p, (1,))
    for r in range(1, p):
        b.transfer(r, 0, 0, reduce=True)
    for r in range(1, p):
        b.transfer(0, r, 0)
    return b.build()


def span_ring_allreduce(p, k):
    """The ring of :func:`ring_allreduce` with each block's ``k`` pieces in one span (one message)."""
    b = ScheduleBuilder("allreduce", p, (1,) * (p * k), algorithm="test-span-ring")
    blocks = [b.runs(range(block * k, (block + 1) * k)) for block in range(p)]
    for phase, reduce in ((1, True), (0, False)):
        for t in range(p - 1):
            for i in range(p):
                for c in blocks[(i - t - phase) % p]:
                    b.transfer(i, (i + 1) % p, c, reduce=reduce)
    return b.build()


def replace_programs(sched, programs):
    return dataclasses.replace(sched, programs=tuple(tuple(p) for p in programs))


# ---- chunk geometry ----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(pattern=st.lists(st.integers(1, 50), min_size=1, max_size=9), nranks=st.integers(1, 9),
       collective=st.sampled_from(["allreduce", "reduce_scatter", "allgather", "broadcast"]),
       count=st.integers(0, 5000))
def test_chunk_ranges_partition_the_buffer_exactly(pattern, nranks, collective, count):
    sched = Schedule(collective, nranks, tuple(pattern), tuple(() for _ in range(nranks)))
    if collective in ("reduce_scatter", "allgather"):
        count -= count % nranks
    r = sched.chunk_ranges(count)
    assert r.shape == (sched.nchunks, 2)
    assert r[0, 0] == 0 and r[-1, 1] == count
    assert np.all(r[1:, 0] == r[:-1, 1]), "chunks must tile the buffer with no gap or overlap"
    assert np.all(r[:, 1] >= r[:, 0])
    if collective in ("reduce_scatter", "allgather"):
        per_block = len(pattern)
        for b in range(nranks):
            assert r[b * per_block, 0] == b * (count // nranks), "block b must start where rank b's block does"
    assert sched.chunk_fractions.sum() == pytest.approx(1.0)


def test_chunk_ranges_follow_weights():
    sched = Schedule("allreduce", 2, (1, 3), ((), ()))
    assert sched.chunk_ranges(8).tolist() == [[0, 2], [2, 8]]
    assert sched.chunk_ranges(1).tolist() == [[0, 0], [0, 1]]


def test_chunk_ranges_stay_exact_for_huge_buffers_and_weights():
    """block * cumulative weight can leave int64: the ranges are then computed in Python integers."""
    sched = Schedule("allreduce", 2, (1 << 40, 1), ((), ()))
    count = 10 ** 7
    assert sched.chunk_ranges(count).tolist() == [[0, count * (1 << 40) // ((1 << 40) + 1)],
                                                  [count * (1 << 40) // ((1 << 40) + 1), count]]
    big = Schedule("allreduce", 2, (3, 5), ((), ())).chunk_ranges(1 << 61)
    assert big.tolist() == [[0, (1 << 61) * 3 // 8], [(1 << 61) * 3 // 8, 1 << 61]]
    with pytest.raises(ScheduleError, match="sum to .* at most 281474976710656"):
        Schedule("allreduce", 2, (1 << 62, 1 << 62), ((), ()))
    # a numpy integer count is the same count (its fixed width must not wrap the check)
    heavy = Schedule("allreduce", 2, (1 << 47, 1 << 47), ((), ()))
    for count in (np.int64(1 << 20), np.int32(1 << 20), np.uint64(1 << 20)):
        assert heavy.chunk_ranges(count).tolist() == [[0, 1 << 19], [1 << 19, 1 << 20]]
    with pytest.raises(TypeError):
        heavy.chunk_ranges(1.0 * (1 << 20))
    for count in (1 << 62, 4 * ((1 << 62) + 3)):      # int64 offsets: refused, not wrapped to negative ones
        with pytest.raises(ScheduleError, match="beyond what a schedule indexes"):
            Schedule("allgather", 4, (1,), ((),) * 4).chunk_ranges(count)


def test_reduce_scatter_count_must_divide():
    sched = Schedule("reduce_scatter", 3, (1,), ((), (), ()))
    with pytest.raises(ScheduleError, match="divisible by 3"):
        sched.chunk_ranges(10)


def test_invalid_schedules_are_refused():
    with pytest.raises(ScheduleError, match="unknown collective"):
        Schedule("alltoall", 1, (1,), ((),))
    with pytest.raises(ScheduleError, match="programs for"):
        Schedule("allreduce", 2, (1,), ((),))
    with pytest.raises(ScheduleError, match="positive integers"):
        Schedule("allreduce", 1, (0,), ((),))
    with pytest.raises(ScheduleError, match="root"):
        Schedule("broadcast", 2, (1,), ((), ()), root=2)


# ---- dependencies and matching ------------------------------------------------------------------------
def test_dependencies_follow_the_dataflow_rule():
    prog = (Op("send", 0, 1), Op("send", 1, 1), Op("reduce", 0, 2), Op("send", 0, 3), Op("send", 0, 4),
            Op("recv", 0, 2))
    sched = Schedule("allreduce", 5, (1, 1), (prog, (), (), (), ()))
    deps = sched.dependencies[0]
    assert deps[0] == () and deps[1] == ()          # different chunks never wait on each other
    assert deps[2] == (0,)                          # a write waits for the send of the old value
    assert deps[3] == (2,) and deps[4] == (2,)      # sends wait for the last write, not for each other
    assert set(deps[5]) == {2, 3, 4}                # an overwrite waits for every read and the last write


def test_matching_is_fifo_per_pair_and_chunk():
    sched = ring_allreduce(3)
    for r, prog in enumerate(sched.programs):
        for i, op in enumerate(prog):
            pr, pi = sched.matches[r][i]
            partner = sched.programs[pr][pi]
            assert pr == op.peer and partner.peer == r and partner.chunk == op.chunk
            assert (op.kind == "send") != (partner.kind == "send")


def test_vectorised_matching_agrees_with_the_op_by_op_one():
    """numpy pairs the k-th send with the k-th receive of each (source, destination, chunk); the
    op-by-op matcher, which names bad operations, must find the same pairs (several messages of one
    chunk between one pair included: recursive doubling's folded ranks, a ring with k > 1)."""
    from ddl.algorithms import halving_doubling_schedule, recursive_doubling_schedule
    from ddl.schedule import _match, _match_checked
    order = [4, 0, 3, 1, 2, 6, 5]
    for sched in (ring_allreduce(5, k=3), recursive_doubling_schedule(order, "allreduce", 2),
                  halving_doubling_schedule(order, "reduce_scatter", 2), star_allreduce(4)):
        assert _match(sched) == _match_checked(sched)
    assert _match(Schedule("allreduce", 2, (1,), ((), ()))) == ((), ())


def test_dataflow_is_the_programs_dependencies_and_matches_as_one_sequence():
    """The simulator and the verifier replay ``dataflow``, built with numpy; it must say exactly what
    ``dependencies`` and ``matches`` say op by op (dependents in program order: the replay order)."""
    from ddl.algorithms import halving_doubling_schedule, hierarchical_schedule, recursive_doubling_schedule
    from ddl.schedule import OP_KINDS, _program_dependencies
    order = [4, 0, 3, 1, 2, 6, 5]
    prog = (Op("send", 0, 1), Op("send", 1, 1), Op("reduce", 0, 1), Op("send", 0, 1), Op("send", 0, 1),
            Op("recv", 0, 1))
    other = (Op("recv", 0, 0), Op("recv", 1, 0), Op("send", 0, 0), Op("recv", 0, 0), Op("recv", 0, 0),
             Op("send", 0, 0))
    schedules = [ring_allreduce(5, k=3), recursive_doubling_schedule(order, "allreduce", 2),
                 halving_doubling_schedule(order, "reduce_scatter", 2), star_allreduce(4),
                 hierarchical_schedule(order, [[order[:3], order[3:]]], "allgather", 2),
                 hierarchical_schedule(order, [[order[:3], order[3:]]], "broadcast", 3, root=3),
                 Schedule("allreduce", 2, (1, 1), (prog, other)), Schedule("allreduce", 3, (1,), ((), (), ()))]
    schedules += [span_ring_allreduce(5, 3), halving_doubling_schedule(order, "allreduce", 2),
                  hierarchical_schedule(range(12), [[(h, h + 1) for h in range(0, 12, 2)]], "allreduce", 2, waves=2,
                                        span_pieces=2)]
    assert all(s.spans for s in schedules[-3:])
    for sched in schedules:
        df = sched.dataflow
        expected = {"kind": [], "rank": [], "chunk": [], "partner": [], "waiting": []}
        dependents = [[] for _ in range(sched.nops)]
        for r, prog in enumerate(sched.programs):
            assert df.starts[r] == len(expected["kind"])
            if not sched.spans:
                assert _program_dependencies(prog) == sched.dependencies[r]
            for i, (op, deps) in enumerate(zip(prog, sched.dependencies[r])):
                peer, j = sched.matches[r][i]
                for column, value in zip(expected.values(), (OP_KINDS.index(op.kind), r, op.chunk,
                                                               df.starts[peer] + j, len(deps))):
                    column.append(value)
                for d in deps:
                    dependents[df.starts[r] + d].append(df.starts[r] + i)
        assert df.starts[-1] == sched.nops
        assert {column: getattr(df, column) for column in expected} == expected
        assert df.dependents == dependents


def test_unmatched_and_out_of_range_ops_are_named():
    sched = ring_allreduce(3)
    progs = [list(p) for p in sched.programs]
    progs[1].pop()  # drop rank 1's last receive
    ok, msg = check(replace_programs(sched, progs))
    assert not ok and "rank 1" in msg and "time(s)" in msg
    with pytest.raises(ScheduleError, match="peer 7"):
        verify(Schedule("allreduce", 2, (1,), ((Op("send", 0, 7),), ())))
    with pytest.raises(ScheduleError, match="chunk 4 out of range"):
        verify(Schedule("allreduce", 2, (1,), ((Op("send", 4, 1),), (Op("recv", 4, 0),))))
    with pytest.raises(ScheduleError, match="unknown operation"):
        verify(Schedule("allreduce", 2, (1,), ((Op("put", 0, 1),), ())))
    with pytest.raises(ScheduleError, match="rank 0 sends it to rank 1 2 time"):
        verify(Schedule("allreduce", 2, (1,), ((Op("send", 0, 1), Op("send", 0, 1)), (Op("recv", 0, 0),))))


# ---- verifier ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", range(1, 10))
def test_reference_schedules_verify(p):
    verdict = verify(ring_allreduce(p, k=2))
    assert verdict.reductions == p * (p - 1) * 2
    verify(star_allreduce(p))


def test_double_counting_is_caught():
    b = ScheduleBuilder("allreduce", 2, (1,))
    b.transfer(0, 1, 0, reduce=True)
    b.transfer(1, 0, 0, reduce=True)  # rank 1 sends 0+1 back: rank 0's part counted twice
    with pytest.raises(ScheduleError, match=r"rank\(s\) \[0\].*counted twice"):
        verify(b.build())


def test_missing_contribution_is_named():
    b = ScheduleBuilder("allreduce", 3, (1,))
    b.transfer(1, 0, 0, reduce=True)
    b.transfer(0, 1, 0)
    b.transfer(0, 2, 0)
    with pytest.raises(ScheduleError, match=r"chunk 0 on rank 0 lacks the contribution of rank\(s\) \[2\]"):
        verify(b.build())


def test_deadlock_is_reported_with_the_stuck_operations():
    # Each rank must first receive chunk 0 from the other before it may send its own (overwritten) value.
    progs = ((Op("recv", 0, 1), Op("send", 0, 1)), (Op("recv", 0, 0), Op("send", 0, 0)))
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 op 0 \(recv chunk 0 from rank 1\)"):
        verify(Schedule("allreduce", 2, (1,), progs))


def test_different_reduction_orders_across_ranks_are_refused():
    # All-to-all exchange: each rank reduces the others' values into its own in a different order,
    # so floats would differ in the last bits between ranks.
    b = ScheduleBuilder("allreduce", 3, (1,))
    b.round([(src, dst, 0, True) for dst in range(3) for src in range(3) if src != dst])
    with pytest.raises(ScheduleError, match="different orders"):
        verify(b.build())


def test_operand_order_puts_the_lowest_contributor_first():
    """Ranks 0 and 3 swap and reduce (A = x0 op x3 on both), 1 and 2 too (B = x1 op x2); then 0 and 1
    swap, and 2 and 3. max(-0.0, +0.0) and max(+0.0, -0.0) differ, so every rank must compute A op B:
    A holds rank 0's contribution, so it goes first, whichever operand is local. Ordered by the
    sender's rank instead, ranks 2 and 3 would compute B op A."""
    from ddl.verify import operand_order
    b = ScheduleBuilder("allreduce", 4, (1,))
    b.round([(0, 3, 0, True), (3, 0, 0, True), (1, 2, 0, True), (2, 1, 0, True)])
    b.round([(0, 1, 0, True), (1, 0, 0, True), (2, 3, 0, True), (3, 2, 0, True)])
    sched = b.build()
    assert "operand_order" not in sched.__dict__
    verify(sched)                                      # works it out on the way
    order, starts = sched.operand_order, sched.dataflow.starts
    firsts = [[order[starts[r] + i] for i, op in enumerate(sched.programs[r]) if op.kind == "reduce"]
              for r in range(4)]
    assert firsts == [[False, False], [False, True], [True, True], [True, False]]
    assert operand_order(sched) == order               # the same from scratch
    assert all(sched.operand_order_of(r) == [order[starts[r] + i] for i in range(len(sched.programs[r]))]
               for r in range(4))
    assert not any(order[starts[r] + i] for r in range(4)
                   for i, op in enumerate(sched.programs[r]) if op.kind != "reduce")


def test_a_round_ships_the_values_held_before_it():
    """Every rank's sends of a round precede its receives, in the order given. Ranks 0 and 1 swap,
    then in one round rank 2 takes 0's sum and sends its own x2 to both: all end with (x0 + x1) + x2.
    The same transfers appended one by one would have rank 2 send x2 + x0 + x1 back."""
    swap = [(0, 1, 0, True), (1, 0, 0, True)]
    last = [(0, 2, 0, True), (2, 0, 0, True), (2, 1, 0, True)]
    b = ScheduleBuilder("allreduce", 3, (1,))
    b.round(swap)
    b.round(last)
    sched = b.build()
    assert sched.programs[2] == (Op("send", 0, 0), Op("send", 0, 1), Op("reduce", 0, 0))
    verify(sched)
    b = ScheduleBuilder("allreduce", 3, (1,))
    b.round(swap)
    for src, dst, chunk, reduce in last:
        b.transfer(src, dst, chunk, reduce)
    with pytest.raises(ScheduleError, match="counted twice"):
        verify(b.build())


def test_reduce_into_empty_chunk_and_missing_block():
    b = ScheduleBuilder("allgather", 2, (1,))
    b.transfer(0, 1, 0, reduce=True)  # rank 1 holds nothing in block 0 yet
    with pytest.raises(ScheduleError, match="holds no data"):
        verify(b.build())
    b = ScheduleBuilder("allgather", 2, (1,))
    b.transfer(0, 1, 0)
    with pytest.raises(ScheduleError, match="chunk 1 never reaches rank 0"):
        verify(b.build())
    b = ScheduleBuilder("broadcast", 3, (1,), root=1)
    b.transfer(1, 0, 0)
    b.transfer(0, 2, 0)
    verify(b.build())
    b = ScheduleBuilder("broadcast", 3, (1,), root=1)
    b.transfer(2, 0, 0)
    with pytest.raises(ScheduleError, match="holds no data"):
        verify(b.build())
    b = ScheduleBuilder("broadcast", 3, (1,), root=1)   # correct everywhere, but the root gets its own data back
    b.transfer(1, 0, 0)
    b.transfer(0, 2, 0)
    b.transfer(2, 1, 0)
    with pytest.raises(ScheduleError, match=r"rank 1 op 1 \(recv chunk 0 from rank 2\): the root of a broadcast "
                                            r"receives nothing"):
        verify(b.build())


def test_reduce_scatter_checks_only_the_owner():
    b = ScheduleBuilder("reduce_scatter", 2, (1,))
    b.transfer(1, 0, 0, reduce=True)
    b.transfer(0, 1, 1, reduce=True)
    verify(b.build())
    b = ScheduleBuilder("reduce_scatter", 2, (1,))
    b.transfer(1, 0, 1, reduce=True)  # reduces the wrong block onto rank 0
    b.transfer(0, 1, 0, reduce=True)
    with pytest.raises(ScheduleError, match="chunk 0 on rank 0 lacks"):
        verify(b.build())


# ---- spans ------------------------------------------------------------------------------------------
def test_runs_make_one_span_per_run_inside_a_block():
    b = ScheduleBuilder("reduce_scatter", 2, (1, 1, 1))          # blocks: chunks 0-2 and 3-5
    assert b.runs([5, 0, 1, 2, 3]) == [6, 3, 5]                  # 0..2 is span 6 (3 starts block 1)
    assert b.runs([3, 4, 5]) == [7] and b.runs([0, 1, 2]) == [6]    # the same run, the same span
    assert b.runs([0, 1, 2], most=2) == [0, 8]                   # at most two chunks per span
    assert b.runs([3, 4, 5], pieces=3) == [3, 4, 5]
    sched = b.build()
    assert sched.spans == ((0, 3), (3, 3), (1, 2)) and sched.nids == 9
    assert list(sched.members(7)) == [3, 4, 5] and sched.block_of(7) == 1
    assert np.allclose(sched.chunk_fractions, [1 / 6] * 6 + [1 / 2, 1 / 2, 1 / 3])
    ranges = sched.chunk_ranges(12)
    assert ranges[6:].tolist() == [[0, 6], [6, 12], [2, 6]]


def test_invalid_spans_are_refused():
    for spans in [((0, 1),), ((1, 2),), ((3, 2),), ((-1, 2),), ((1, 2, 3),), ((0, 2.0),)]:
        with pytest.raises(ScheduleError, match="span 0"):
            Schedule("reduce_scatter", 2, (1, 1), ((), ()), spans=spans)   # blocks: chunks 0-1 and 2-3
    assert Schedule("reduce_scatter", 2, (1, 1), ((), ()), spans=((0, 2), (2, 2))).nids == 6


def test_span_dependencies_are_those_of_its_chunks():
    """A span waits for every op on any of its chunks that the rule says it must, and ops on one of
    its chunks wait for it likewise."""
    prog = (Op("reduce", 0, 1),       # 0: writes chunk 0
            Op("send", 2, 1),         # 1: span (0, 1): waits for 0
            Op("send", 1, 1),         # 2: chunk 1: nothing written yet
            Op("recv", 1, 1),         # 3: writes chunk 1: waits for the sends of it, 1 and 2
            Op("reduce", 2, 1))       # 4: span: waits for the last writes (0, 3) and the sends since (1)
    sched = Schedule("allreduce", 2, (1, 1), (prog, ()), spans=((0, 2),))
    assert sched.dependencies[0] == ((), (0,), (), (1, 2), (0, 1, 3))   # 4: chunk 0 after 0 and 1, chunk 1 after 3


def test_span_schedules_verify_and_errors_name_the_span():
    sched = span_ring_allreduce(4, 3)
    assert len(sched.spans) == 4 and sched.nops == ring_allreduce(4, 3).nops // 3
    assert verify(sched).reductions == verify(ring_allreduce(4, 3)).reductions   # each chunk reduced as before
    again = Schedule.from_json(sched.to_json())
    assert again == sched and again.spans == sched.spans
    progs = [list(p) for p in sched.programs]
    i = next(i for i, op in enumerate(progs[1]) if op.kind == "reduce")
    progs[1][i] = Op("recv", progs[1][i].chunk, progs[1][i].peer)   # a reduction dropped: a contribution lost
    ok, msg = check(replace_programs(sched, progs))
    assert not ok and "lacks the contribution" in msg
    b = ScheduleBuilder("allreduce", 2, (1, 1))
    span = b.runs([0, 1])[0]
    b.transfer(0, 1, span, reduce=True)
    b.transfer(0, 1, 0, reduce=True)                 # chunk 0 of rank 0 counted twice on rank 1
    with pytest.raises(ScheduleError, match="rank 1 op 1 .*counted twice"):
        verify(b.build())
    b = ScheduleBuilder("broadcast", 3, (1, 1), root=0)
    b.transfer(0, 1, 0)
    b.transfer(1, 2, b.runs([0, 1])[0])              # rank 1 forwards chunk 1 before it has it
    b.transfer(0, 1, 1)
    with pytest.raises(ScheduleError, match=r"span 2 \(chunks 0\.\.1\).*chunk 1 holds no data"):
        verify(b.build())


def test_a_proof_stops_when_asked():
    from ddl.verify import Abandoned
    sched = ring_allreduce(40, k=24)                  # 149760 operations
    asked = []

    def stop_at(call):                                # says yes at its call-th call
        return lambda: asked.append(1) or len(asked) >= call

    with pytest.raises(Abandoned, match="before it started"):
        verify(sched, stop=stop_at(1))
    assert "dataflow" not in sched.__dict__           # nothing was built
    for call, when in ((2, "after the dataflow"), (3, "after the initial state"), (4, "after 65536 operations"),
                       (5, "after 131072 operations")):
        asked.clear()
        with pytest.raises(Abandoned, match=when):
            verify(sched, stop=stop_at(call))
        assert len(asked) == call
    asked.clear()
    assert verify(sched, stop=stop_at(6)).nops == sched.nops and len(asked) == 5


# ---- serialisation ------------------------------------------------------------------------------------
def test_json_round_trip_is_lossless(tmp_path):
    b = ScheduleBuilder("broadcast", 3, (2, 1), root=2, algorithm="chain")
    b.transfer(2, 1, 0)
    b.transfer(2, 1, 1)
    b.transfer(1, 0, 0)
    b.transfer(1, 0, 1)
    b.routes[(2, 1)] = ((("h2", "sw", "h1"), 0.5), (("h2", "sw2", "h1"), 0.5))
    sched = b.build(order=[2, 1, 0])
    again = Schedule.from_json(sched.to_json())
    assert again == sched and again.routes == sched.routes and again.info == {"order": [2, 1, 0]}
    sched.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json").to_dict() == sched.to_dict()
    older = {key: value for key, value in sched.to_dict().items() if key != "spans"}
    assert Schedule.from_dict({**older, "format": "ddl.schedule/1"}) == sched     # before spans
    twice = sched.to_dict()
    twice["routes"] = twice["routes"] * 2                     # a hand edit that lists a pair twice
    with pytest.raises(ScheduleError, match="routes: pair 2 -> 1 is listed twice"):
        Schedule.from_dict(twice)
    for key, value in (("algorithm", 5), ("algorithm", None), ("info", [1])):
        with pytest.raises(ScheduleError, match='"algorithm" must be a string and "info" a mapping'):
            Schedule.from_dict({**sched.to_dict(), key: value})



def test_a_schedule_built_from_numpy_integers_saves_under_the_longest_name(tmp_path):
    # ranks and chunks taken from numpy arrays are numpy integers, which JSON cannot write; and the
    # temporary file beside the target must fit where a 255-byte name does
    ranks = np.arange(3)
    b = ScheduleBuilder("broadcast", np.int64(3), (1,), root=ranks[2])
    b.transfer(ranks[2], ranks[1], np.int64(0))
    b.transfer(ranks[1], ranks[0], np.int64(0))
    b.routes[(ranks[2], ranks[1])] = ((("h2", "h1"), np.float64(1.0)),)
    sched = b.build()
    verify(sched)
    path = tmp_path / ("s" * 250 + ".json")
    sched.save(path)
    again = Schedule.load(path)
    assert again == sched and again.routes == {(2, 1): ((("h2", "h1"), 1.0),)}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]

def test_bad_json_is_a_schedule_error():
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.from_json("{")
    with pytest.raises(ScheduleError, match="not a ddl schedule"):
        Schedule.from_json('{"collective": "allreduce"}')
    with pytest.raises(ScheduleError, match='the schedule has no "nranks"'):
        Schedule.from_json('{"format": "ddl.schedule/1", "collective": "allreduce"}')
    with pytest.raises(ScheduleError, match="nested too deeply"):
        Schedule.from_json("[" * 100000 + "]" * 100000)


@pytest.mark.parametrize("edit,what", [
    (lambda d: d["programs"][0][0].__setitem__(2, 1.5), "two integers"),
    (lambda d: d["programs"][0][0].__setitem__(1, "0"), "two integers"),
    (lambda d: d["pattern"].__setitem__(0, 0.5), r"pattern\[0\] must be an integer, got 0.5"),
    (lambda d: d["pattern"].__setitem__(0, True), r"pattern\[0\] must be an integer, got True"),
    (lambda d: d.__setitem__("nranks", 3.9), "nranks must be an integer, got 3.9"),
    (lambda d: d.__setitem__("nranks", float("inf")), "nranks must be an integer"),
    (lambda d: d.__setitem__("root", 1.7), "root must be an integer, got 1.7"),
    (lambda d: d.__setitem__("routes", [{"src": 99, "dst": 0, "paths": [{"via": ["a", "b"], "share": 1.0}]}]),
     r"routes: \(99, 0\) is not a pair of two ranks of 3")])
def test_hand_edited_numbers_are_refused_not_truncated(edit, what):
    """A hand-edited 1.5 must not load as 1: it names the field instead."""
    d = ring_allreduce(3).to_dict()
    edit(d)
    with pytest.raises(ScheduleError, match=what):
        Schedule.from_json(json.dumps(d))


def routed_ring(p=4):
    """:func:`ring_allreduce` as a dict, with one pinned route (rank 0 -> 1) to edit."""
    d = ring_allreduce(p).to_dict()
    d["routes"] = [{"src": 0, "dst": 1, "paths": [{"via": ["r0", "sw", "r1"], "share": 1.0}]}]
    return d


def _set(path, value):
    """An edit of a schedule dict: the entry at ``path`` (keys and indices) becomes ``value``."""
    def edit(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit,says", [
    (_set(("programs", 2, 5), ["send", 3]), "programs[2][5]: an operation is [kind, chunk, peer], a string and "
                                             "two integers, got ['send', 3]"),
    (_set(("programs", 0, 0), ["send", 0, 1, 5]), "programs[0][0]: an operation is [kind, chunk, peer]"),
    (_set(("programs", 1, 3), {"kind": "send"}), "programs[1][3]: an operation is [kind, chunk, peer], a string "
                                                  "and two integers, got {'kind': 'send'}"),
    (_set(("programs", 3, 0), "abc"), "programs[3][0]: an operation is [kind, chunk, peer], a string and two "
                                      "integers, got 'abc'"),
    (_set(("programs", 0, 1), 7), "programs[0][1]: an operation is [kind, chunk, peer]"),
    (_set(("programs", 0, 1), ["send", True, 1]), "programs[0][1]: an operation is [kind, chunk, peer]"),
    (_set(("programs", 1), None), "programs[1] must be a list of operations [kind, chunk, peer], got None"),
    (_set(("programs",), {"0": []}), "programs must be a list of programs, one per rank"),
    (_set(("pattern",), 4), "pattern must be a list of chunk weights, got 4"),
    (_set(("spans",), [[0]]), "spans[0]: a span is [first, count], two integers, got [0]"),
    (_set(("spans",), [[0, 2], [0, 1, 2]]), "spans[1]: a span is [first, count], two integers, got [0, 1, 2]"),
    (_set(("spans",), "ab"), "spans must be a list of [first, count] pairs, got 'ab'"),
    (_set(("routes",), "x"), 'routes must be a list of {"src", "dst", "paths"} entries, got \'x\''),
    (_set(("routes", 0), 5), 'routes[0] must be a mapping {"src": rank, "dst": rank, "paths": [...]}, got 5'),
    (_set(("routes", 0, "src"), "0"), "routes[0].src must be an integer, got '0'"),
    (lambda d: d["routes"][0].pop("paths"), 'routes[0] has no "paths"'),
    (_set(("routes", 0, "paths"), "x"), 'routes[0].paths must be a list of {"via", "share"} entries, got \'x\''),
    (_set(("routes", 0, "paths", 0), ["r0", "r1"]), 'routes[0].paths[0] must be a mapping {"via": [node, ...], '
                                                    '"share": number}'),
    (_set(("routes", 0, "paths", 0, "via"), [{"a": 1}]), "routes[0].paths[0].via must be a list of node names "
                                                          "(strings), got [{'a': 1}]"),
    (_set(("routes", 0, "paths", 0, "via"), [["a"]]), "routes[0].paths[0].via must be a list of node names"),
    (_set(("routes", 0, "paths", 0, "via"), ["r0", 5, "r1"]), "routes[0].paths[0].via must be a list of node names"),
    (_set(("routes", 0, "paths", 0, "via"), "r0"), "routes[0].paths[0].via must be a list of node names"),
    (_set(("routes", 0, "paths", 0, "via"), None), "routes[0].paths[0].via must be a list of node names"),
    (_set(("routes", 0, "paths", 0, "share"), True), "routes[0].paths[0].share must be a finite number >= 0"),
    (_set(("routes", 0, "paths", 0, "share"), "1e308"), "routes[0].paths[0].share must be a finite number >= 0"),
    (_set(("routes", 0, "paths", 0, "share"), [1]), "routes[0].paths[0].share must be a finite number >= 0"),
    (_set(("routes", 0, "paths", 0, "share"), -1), "routes[0].paths[0].share must be a finite number >= 0"),
    (_set(("routes", 0, "paths", 0, "share"), float("nan")), "routes[0].paths[0].share must be a finite number"),
    (_set(("routes", 0, "paths", 0, "share"), 10 ** 400), "routes[0].paths[0].share must be a finite number"),
    (lambda d: d["routes"][0]["paths"].append({"via": ["r0", "sw", "r1"], "share": 1e308}) or
     d["routes"][0]["paths"][0].__setitem__("share", 1e308), "routes[0]: the shares add up to more than a float holds"),
    (lambda d: d.pop("collective"), 'the schedule has no "collective"'),
])
def test_a_wrong_entry_is_named_with_what_it_should_be(edit, says):
    """A hand edit of the wrong shape is refused with one ScheduleError that names the entry, never a
    TypeError from deep inside a tool (a route's via of dicts failed in the simulator, unhashable)."""
    d = routed_ring()
    edit(d)
    with pytest.raises(ScheduleError) as err:
        Schedule.from_json(json.dumps(d))
    assert str(err.value).startswith(says), str(err.value)


def test_reading_checks_whole_programs_and_loads_what_it_wrote():
    """Operations are made a program at a time: what is read equals what was written, Ops and all, and
    one wrong operation far into a long program is found and named."""
    sched = span_ring_allreduce(5, 3)
    again = Schedule.from_json(sched.to_json())
    assert again == sched and all(type(op) is Op for prog in again.programs for op in prog)
    d = sched.to_dict()
    d["programs"][4][-1] = [d["programs"][4][-1][0], 1.0, d["programs"][4][-1][2]]
    with pytest.raises(ScheduleError, match=rf"^programs\[4\]\[{len(d['programs'][4]) - 1}\]: an operation"):
        Schedule.from_dict(d)


def device_or_fifo(path):
    """A character device like /dev/null at ``path`` where this user may make one (root), else a FIFO."""
    import os
    import stat
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        return "a character device"
    except OSError:
        os.mkfifo(path)
        return "a FIFO (named pipe)"


def test_a_write_follows_a_symlink_and_refuses_what_is_not_a_file(tmp_path):
    """``ddl plan --save LINK`` wrote a file in place of the link; ``--save`` onto a device node turned it
    into a regular file (as root, ``--save /dev/null`` would replace the system's /dev/null)."""
    import os
    import stat

    from ddl.schedule import write_file

    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real.name)
    old = os.umask(0o022)
    try:
        assert write_file(link, "new")
        assert link.is_symlink() and real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o644
        assert not write_file(link, "other", replace=False) and real.read_text() == "new"
        away = tmp_path / "sub"
        away.mkdir()
        dangling = tmp_path / "dangling.json"
        dangling.symlink_to(away / "made.json")
        assert write_file(dangling, "made", replace=False)            # written where it points, link kept
        assert dangling.is_symlink() and (away / "made.json").read_text() == "made"
    finally:
        os.umask(old)
    special = tmp_path / "null"
    kind = device_or_fifo(special)
    to_special = tmp_path / "to-null"
    to_special.symlink_to(special)
    for path, says in ((special, f"{kind}, not a regular file"),
                       (to_special, f"links to {special}, {kind}, not a regular file"),
                       (away, "a folder, not a regular file")):
        for replace in (True, False):
            with pytest.raises(OSError) as err:
                write_file(path, "x", replace=replace)
            assert err.value.filename == str(path) and says in err.value.strerror
    assert not stat.S_ISREG(special.stat().st_mode) and to_special.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json", "null", "real.json", "sub",
                                                           "to-null"]    # no temporary file left


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 6), k=st.integers(1, 3), data=st.data())
def test_verifier_rejects_any_dropped_transfer(p, k, data):
    """Removing one transfer (both halves) from a correct ring always breaks it, and the verifier says so."""
    sched = ring_allreduce(p, k)
    rank = data.draw(st.integers(0, p - 1))
    sends = [i for i, op in enumerate(sched.programs[rank]) if op.kind == "send"]
    i = data.draw(st.sampled_from(sends))
    pr, pi = sched.matches[rank][i]
    progs = [list(prog) for prog in sched.programs]
    del progs[rank][i]
    del progs[pr][pi]
    ok, msg = check(replace_programs(sched, progs))
    assert not ok and msg

"""Review of ddl.units and ddl.topology_file: bad input that used to escape as a Python traceback (or
be accepted silently), each with the smallest reproduction."""
import json

import numpy as np
import pytest

from ddl import TopologyError
from ddl.planner import flat_topology, Planner
from ddl.topology import Topology
from ddl.units import MAX_SIZE, message_size, parse_bandwidth, parse_latency, parse_size
from test_topology_format import pair


def load_error(tmp_path, text, name="topo.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    assert info.value.source == str(path) and str(path) in str(info.value)
    return info.value


# ------------------------------------------------------------------------------------------- units

@pytest.mark.parametrize("text,size", [("1 PiB", 2**50), ("1PiB", 2**50), ("1 EiB", 2**60), ("1EiB", 2**60),
                                       ("2 PB", 2 * 10**15), ("1 EB", 10**18), ("0.5EiB", 2**59), ("1P", 10**15)])
def test_sizes_up_to_the_limit_can_be_written_with_their_unit(text, size):
    """MAX_SIZE is 1 EiB and its message says so, yet '1 EiB' (and any PiB) could not be written."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["2 EiB", "1025 PiB", "1.5EiB"])
def test_sizes_beyond_one_eib_in_the_new_units_are_refused(text):
    with pytest.raises(ValueError, match="beyond 1 EiB"):
        parse_size(text)


def test_the_new_size_units_are_not_bandwidth_units():
    """README: the largest bandwidth unit is TB/s (write 1 EB/s as 1000000 TB/s)."""
    for text in ("1 PB/s", "1 EB/s", "1 PiB/s"):
        with pytest.raises(ValueError, match="GB/s"):
            parse_bandwidth(text)


@pytest.mark.parametrize("value", [2**60 + 1, 2**70, 10**400], ids=["2**60+1", "2**70", "10**400"])
def test_an_integer_size_beyond_one_eib_is_refused_like_its_text(value):
    """parse_size('1180591620717411303424') said 'beyond 1 EiB' but the int 2**70 was accepted, and
    Planner.plan('allreduce', 10**400) escaped as an OverflowError from deep in the planner."""
    with pytest.raises(ValueError, match="beyond 1 EiB"):
        parse_size(value)
    with pytest.raises(ValueError, match="beyond 1 EiB"):
        message_size(value)
    assert parse_size(MAX_SIZE) == MAX_SIZE


def test_planner_refuses_an_absurd_integer_size_with_a_plan_error(tmp_path):
    from ddl import PlanError
    planner = Planner(flat_topology(2), cache_dir=tmp_path)
    with pytest.raises(PlanError, match="beyond 1 EiB"):
        planner.plan("allreduce", 10**400)


@pytest.mark.parametrize("value,expected", [(np.int64(5), 5.0), (np.float32(2.5), 2.5), (np.int32(0), 0.0)])
def test_numpy_numbers_are_plain_numbers(value, expected):
    """Python's 5 was 5 B/s (or 5 s) but numpy's was read as text and refused."""
    assert parse_bandwidth(value) == expected and parse_latency(value) == expected


def test_numpy_values_in_a_dict_topology():
    data = pair(bandwidth=np.float32(1e9), count=np.int64(2), latency=np.int64(0))
    link = Topology.from_dict(data).links[0]
    assert (link.bandwidth, link.count, link.latency) == (1e9, 2, 0.0) and type(link.count) is int
    with pytest.raises(TopologyError, match=r"links\[0\]: count must be a whole number >= 1"):
        Topology.from_dict(pair(count=np.int64(0)))
    with pytest.raises(TopologyError, match=r"links\[0\]: count must be a whole number >= 1"):
        Topology.from_dict(pair(count=np.True_))


# ------------------------------------------------------------------------------------- topology file

def test_a_for_count_beyond_a_machine_integer_is_refused_by_name(tmp_path):
    """for: {i: 100000000000000000000000} escaped as OverflowError (len of a huge range)."""
    text = ("name: t\nnodes:\n  - {id: 'g{i}', kind: gpu, for: {i: 100000000000000000000000}}\n"
            "links: []\nranks: [g0]\n")
    err = load_error(tmp_path, text)
    assert err.entry == "nodes[0]" and "repeats this entry 100000000000000000000000 times; at most" in str(err)
    with pytest.raises(TopologyError, match=r"nodes\[3\]: for: repeats this entry"):
        Topology.from_dict({**pair(), "nodes": pair()["nodes"] + [{"id": "x{i}", "kind": "gpu",
                                                                  "for": {"i": 2**64, "j": [0, 1]}}]})


@pytest.mark.parametrize("name,where", [
    ("topo.yaml", "count: {}"), ("topo.yaml", "for: {{i: {}}}"), ("topo.yaml", "bandwidth: {}"),
    ("topo.json", '"count": {}')])
def test_a_number_too_long_to_read_is_a_topology_error(tmp_path, name, where):
    """A 5000-digit integer made YAML and JSON raise Python's ValueError 'Exceeds the limit (4300
    digits) for integer string conversion', a traceback instead of a message."""
    digits = "9" * 5000
    if name.endswith(".json"):
        text = '{"name": "t", "links": [{' + where.format(digits) + '}]}'
    else:
        text = f"name: t\nlinks:\n  - {{a: x, b: y, {where.format(digits)}}}\n"
    err = load_error(tmp_path, text, name)
    assert "number" in str(err) and "digits" in str(err) and len(str(err)) < 400


def test_a_tab_in_the_indentation_is_named(tmp_path):
    """The message said 'found character that cannot start any token': a tab is invisible in an editor."""
    for text, line in (("name: x\nnodes:\n\t- {id: s, kind: switch}\n", 3),
                       ("name: x\nnodes:\n  - id: s\n\t  kind: gpu\n", 4)):
        err = load_error(tmp_path, text)
        assert f"line {line}, column 1" in str(err) and "(a tab: YAML indents with spaces only" in str(err)
    err = load_error(tmp_path, "name: x\nnodes: [a\n")       # no tab: no word about tabs
    assert "a tab" not in str(err)


def test_an_unpaired_surrogate_in_an_id_is_refused(tmp_path):
    """JSON's '\\ud800' escape (and YAML's, read without libyaml) makes a string that is no text: it
    was accepted and the topology then crashed with UnicodeEncodeError on its fingerprint (on ==,
    hash, caching)."""
    text = json.dumps(pair()).replace('"g0"', '"g\\ud800"')
    err = load_error(tmp_path, text, "topo.json")
    assert err.entry == "nodes[1]" and "unpaired surrogate" in str(err) and "\\ud800" in str(err)
    data = pair()
    data["name"] = "x\udfff"
    with pytest.raises(TopologyError, match=r"<dict>: name: .*unpaired surrogate"):
        Topology.from_dict(data)
    with pytest.raises(TopologyError, match=r"<dict>: description: .*unpaired surrogate"):
        Topology.from_dict({**pair(), "description": "\ud800"})


@pytest.mark.timeout(30)   # the bomb below took minutes to walk before (10x a level: 4.7 s at 7 levels, 45 s at 8)
def test_a_yaml_alias_bomb_in_a_for_entry_is_refused_fast(tmp_path):
    """`for:` filled every string nested in the entry, walking YAML aliases whole: 8 levels of 9 took
    about 45 s (10x per level) before the entry was refused for a host that is not a string."""
    levels = ['&a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    text = (f"name: t\nnodes:\n  - {{id: 'x{{i}}', kind: gpu, host: [{', '.join(levels)}], for: {{i: 2}}}}\n"
            "links: []\nranks: [x0]\n")
    err = load_error(tmp_path, text)
    assert err.entry == "nodes[0] (i=0)" and "host must be a non-empty string, not a list" in str(err)


@pytest.mark.timeout(30)
def test_a_yaml_alias_bomb_as_a_for_value_is_labelled_short(tmp_path):
    """The label of each repetition showed every loop value whole ('p=[[[...'), built in full."""
    levels = ['&a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    text = (f"name: t\nnodes:\n  - {{id: 'x', kind: gpu, host: 3, for: {{i: 1, p: [[{', '.join(levels)}]]}}}}\n"
            "links: []\nranks: [x]\n")
    err = load_error(tmp_path, text)
    assert len(str(err)) < 400
    assert err.entry.startswith("nodes[0] (i=0, p=[['x', 'x'") and err.entry.endswith("...)")
    assert "host must be a non-empty string" in str(err)


def test_for_labels_and_templates_are_unchanged_for_ordinary_values():
    loop = {"i": 2, "p": [[0, 1], ["a", "b"]]}
    data = {"name": "t",
            "nodes": [{"id": "s", "kind": "switch"}, {"id": "g{i}-{p[0]}{p[1]}", "kind": "gpu", "for": loop}],
            "links": [{"a": "g{i}-{p[0]}{p[1]}", "b": "s", "bandwidth": "1 GB/s", "for": loop}],
            "ranks": ["g0-01", "g0-ab", "g1-01", "g1-ab", {"id": "g{i}", "for": {"i": ["x"]}}]}
    with pytest.raises(TopologyError, match=r"ranks\[4\] \(i=x\): rank 'gx' names no node"):
        Topology.from_dict(data)
    data["nodes"][1]["kind"] = 7
    with pytest.raises(TopologyError, match=r"nodes\[1\] \(i=0, p=\[0, 1\]\): kind must be a non-empty string"):
        Topology.from_dict(data)


@pytest.mark.parametrize("spelling, says", [
    ("no", 'not a boolean (False): YAML reads an unquoted no, off or false as a boolean; quote it as the file '
           'spells it, e.g. id: "no"'),
    ("ON", 'not a boolean (True): YAML reads an unquoted yes, on or true as a boolean'),
    ("7", 'not a number (7); quote it as the file spells it, e.g. id: "7"')])
def test_a_name_yaml_read_as_a_boolean_or_number_is_told_how_to_quote_it(tmp_path, spelling, says):
    """(`id: no` was told to quote it as "False", the loaded value rather than the file's word.)"""
    err = load_error(tmp_path, f"name: t\nnodes:\n  - {{id: {spelling}, kind: gpu}}\nlinks: []\nranks: [x]\n")
    assert err.entry == "nodes[0]" and "id must be a non-empty string, " + says in str(err), str(err)


def test_nodes_without_links_are_warned_of_by_name(tmp_path):
    """(2000 switches repeated by a for: without their links were accepted silently; a host node that
    only names a machine, by the ids under it, is no such node.)"""
    text = ("name: t\nnodes:\n  - {id: sw, kind: switch}\n  - {id: box, kind: host}\n"
            "  - {id: 'box/g{i}', kind: gpu, for: {i: 2}}\n  - {id: 'x{k}', kind: switch, for: {k: 2000}}\n"
            "links:\n  - {a: 'box/g{i}', b: sw, bandwidth: 10 GB/s, for: {i: 2}}\nranks: [box/g0, box/g1]\n")
    path = tmp_path / "loose.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.warns(UserWarning) as caught:
        Topology.load(path)
    assert [str(w.message) for w in caught] == [
        f"{path}: 2000 nodes (x0, x1, x2, ...; first at nodes[3] (k=0)) have no link and take no part in a plan: "
        f"link them or remove them"]
    path.write_text(text.replace("  - {id: 'x{k}', kind: switch, for: {k: 2000}}\n", ""), encoding="utf-8")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Topology.load(path).hosts == {"box": (0, 1)}


def test_a_bandwidth_without_its_unit_is_warned_of_once_per_entry(tmp_path):
    """`bandwidth: 100` is 100 B/s by definition, and was planned so without a word (a 1e4-second
    prediction beside 16 GB/s links)."""
    text = ("name: t\nnodes:\n  - {id: sw, kind: switch}\n  - {id: 'g{i}', kind: gpu, for: {i: 3}}\n"
            "links:\n  - {a: 'g{i}', b: sw, bandwidth: 100, for: {i: 3}}\nranks: [g0, g1, g2]\n")
    path = tmp_path / "bare.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.warns(UserWarning) as caught:
        assert Topology.load(path).links[0].bandwidth == 100.0
    assert sorted({str(w.message) for w in caught}) == [
        f"{path}: links[0]: bandwidth 100 has no unit and is read as 100 B/s; write the unit, e.g. '100 Gbit/s' "
        f"or '100 GB/s' (or '100 B/s' if that is meant)"]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # a unit, or a bare number of plausible size: no warning
        Topology.load(_written(tmp_path, text.replace("bandwidth: 100,", "bandwidth: 100 B/s,")))
        Topology.load(_written(tmp_path, text.replace("bandwidth: 100,", "bandwidth: 25000000000,")))


def _written(tmp_path, text):
    path = tmp_path / "t.yaml"
    path.write_text(text, encoding="utf-8")
    return path

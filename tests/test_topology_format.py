"""The topology file format: explicit form, units, count/directed, `for:` repetition, the `tiers:`
hierarchy form, JSON, round trips, and one test per kind of bad input (message names the file, the
entry and a fix)."""
import copy
import json
import pathlib
import re
import textwrap
import time

import pytest
import yaml

from ddl import TopologyError
from ddl.topology import Link, Topology

REPO = pathlib.Path(__file__).resolve().parent.parent

MINI_YAML = """\
name: mini
nodes:
  - {id: sw, kind: switch}
  - {id: h0, kind: host}
  - {id: h0/gpu0, kind: gpu}
  - {id: h0/gpu1, kind: gpu}
links:
  - {a: h0/gpu0, b: h0/gpu1, bandwidth: 25 GB/s, latency: 3 us, count: 2}
  - {a: h0/gpu0, b: h0, bandwidth: 16 GB/s}
  - {a: h0/gpu1, b: h0, bandwidth: 16 GB/s}
  - {a: h0, b: sw, bandwidth: 100 Gbit/s}
ranks: [h0/gpu0, h0/gpu1]
"""


def mini():
    return yaml.safe_load(MINI_YAML)


def pair(bandwidth="10 GB/s", **link):
    """Two GPUs on a switch; `link` overrides keys of the first link."""
    return {"name": "pair",
            "nodes": [{"id": "sw", "kind": "switch"}, {"id": "g0", "kind": "gpu"}, {"id": "g1", "kind": "gpu"}],
            "links": [{"a": "g0", "b": "sw", "bandwidth": bandwidth, **link},
                      {"a": "g1", "b": "sw", "bandwidth": "10 GB/s"}],
            "ranks": ["g0", "g1"]}


def write(tmp_path, data, name="topo.yaml"):
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    elif name.endswith(".json"):
        path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def load_error(tmp_path, data, name="topo.yaml"):
    """Load bad data from a file; the message must name that file."""
    path = write(tmp_path, data, name)
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    assert str(path) in str(info.value)
    assert info.value.source == str(path)
    return info.value


# ---------------------------------------------------------------------------------- explicit form

def test_explicit_minimal_form(tmp_path):
    topo = Topology.load(write(tmp_path, MINI_YAML))
    assert topo.name == "mini"
    assert topo.source == str(tmp_path / "topo.yaml")
    assert topo.nodes == ("sw", "h0", "h0/gpu0", "h0/gpu1")
    assert topo.ranks == ("h0/gpu0", "h0/gpu1") and topo.nranks == 2
    assert topo.kind("sw") == "switch" and topo.kind("h0/gpu1") == "gpu"
    assert topo.links[0] == Link("h0/gpu0", "h0/gpu1", 25e9, 3e-6, 2, False)
    assert topo.links[1].latency == pytest.approx(1e-6)  # the default latency
    assert topo.capacity("h0", "sw") == topo.capacity("sw", "h0") == pytest.approx(12.5e9)
    assert topo.capacity("h0/gpu0", "sw") == 0.0


@pytest.mark.parametrize("text,bytes_per_s", [
    ("1 B/s", 1), ("1 kB/s", 1e3), ("1 MB/s", 1e6), ("1 GB/s", 1e9), ("1 TB/s", 1e12),
    ("1 KiB/s", 2**10), ("1 MiB/s", 2**20), ("1 GiB/s", 2**30), ("8 bit/s", 1), ("8 kbit/s", 1e3),
    ("8 Mbit/s", 1e6), ("8 Gbit/s", 1e9), ("8 Tbit/s", 1e12), ("8 Gb/s", 1e9), ("8 Mb/s", 1e6)])
def test_bandwidth_units_in_links(text, bytes_per_s):
    topo = Topology.from_dict(pair(text))
    assert topo.capacity("g0", "sw") == pytest.approx(bytes_per_s)
    assert topo.links[0].bandwidth == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text,seconds", [("5 ns", 5e-9), ("5 us", 5e-6), ("5 µs", 5e-6), ("5 ms", 5e-3),
                                          ("5 s", 5.0)])
def test_latency_units_in_links(text, seconds):
    topo = Topology.from_dict(pair(latency=text))
    assert topo.latency("g0", "sw") == pytest.approx(seconds)
    assert topo.latency("g1", "sw") == pytest.approx(1e-6)


def test_defaults_latency_applies_to_links_without_one():
    data = pair(latency="7 us")
    data["defaults"] = {"latency": "3 us"}
    topo = Topology.from_dict(data)
    assert topo.latency("g0", "sw") == pytest.approx(7e-6)
    assert topo.latency("sw", "g1") == pytest.approx(3e-6)


def test_count_multiplies_and_parallel_entries_add_up():
    data = pair("10 GB/s", count=3, latency="4 us")
    data["links"].append({"a": "sw", "b": "g0", "bandwidth": "5 GB/s", "latency": "2 us"})
    topo = Topology.from_dict(data)
    assert topo.capacity("g0", "sw") == pytest.approx(35e9)
    assert topo.capacity("sw", "g0") == pytest.approx(35e9)
    assert topo.latency("g0", "sw") == pytest.approx(2e-6)  # the fastest parallel link


def test_directed_links_carry_one_direction():
    data = pair()
    data["links"] = [{"a": "g0", "b": "g1", "bandwidth": "10 GB/s", "directed": True},
                     {"a": "g1", "b": "g0", "bandwidth": "4 GB/s", "directed": True}]
    with pytest.warns(UserWarning, match=r"1 node \(sw; first at nodes\[0\]\) has no link"):   # pair()'s switch
        topo = Topology.from_dict(data)
    assert topo.capacity("g0", "g1") == pytest.approx(10e9)
    assert topo.capacity("g1", "g0") == pytest.approx(4e9)
    assert topo.graph.number_of_edges() == 2


def test_constructor_takes_pairs_dicts_and_links():
    topo = Topology("direct", [("sw", "switch"), {"id": "g0", "kind": "gpu", "reduce_bandwidth": "9 GB/s"},
                               ("g1", "gpu")],
                    [Link("g0", "sw", 10e9), {"a": "g1", "b": "sw", "bandwidth": "10 GB/s"}],
                    ["g0", "g1"], defaults={"latency": "2 us"})
    assert topo.links[0] == Link("g0", "sw", 10e9, 2e-6, 1, False)
    assert topo.reduce_bandwidth(0) == pytest.approx(9e9)
    assert topo == Topology.from_dict(topo.to_dict())


# ------------------------------------------------------------------------------------ repetition

def test_for_expands_in_order_first_variable_slowest():
    data = {"name": "rep",
            "nodes": [{"id": "sw", "kind": "switch"},
                      {"id": "h{i}/gpu{j}", "kind": "gpu", "for": {"i": 2, "j": [0, 2, 5]}}],
            "links": [{"a": "h{i}/gpu{j}", "b": "sw", "bandwidth": "{bw} GB/s",
                       "for": {"i": 2, "j": [0, 2, 5], "bw": [7]}}],
            "ranks": [{"id": "h{i}/gpu{j}", "for": {"j": [5, 0], "i": 2}}]}
    topo = Topology.from_dict(data)
    assert topo.nodes == ("sw", "h0/gpu0", "h0/gpu2", "h0/gpu5", "h1/gpu0", "h1/gpu2", "h1/gpu5")
    assert len(topo.links) == 6 and all(link.bandwidth == 7e9 for link in topo.links)
    assert topo.ranks == ("h0/gpu5", "h1/gpu5", "h0/gpu0", "h1/gpu0")


def test_for_templates_index_into_list_values():
    data = {"name": "pairs",
            "nodes": [{"id": "g{i}", "kind": "gpu", "for": {"i": 4}}],
            "links": [{"a": "g{p[0]}", "b": "g{p[1]}", "bandwidth": "25 GB/s",
                       "for": {"p": [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]}}],
            "ranks": ["g0", {"id": "g{i}", "for": {"i": [1, 2, 3]}}]}
    topo = Topology.from_dict(data)
    assert [(link.a, link.b) for link in topo.links][:3] == [("g0", "g1"), ("g0", "g2"), ("g0", "g3")]
    assert topo.ranks == ("g0", "g1", "g2", "g3")
    assert topo.capacity("g3", "g2") == pytest.approx(25e9)


def test_for_templates_of_count_and_directed_read_back_as_a_number_and_a_boolean(tmp_path):
    """(`count: "{n}"` filled in the text '2', refused as "not a whole number ... not '2'".)"""
    data = {"name": "counted",
            "nodes": [{"id": "sw", "kind": "switch"}, {"id": "g{i}", "kind": "gpu", "for": {"i": 2}}],
            "links": [{"a": "g{i}", "b": "sw", "bandwidth": "10 GB/s", "count": "{n}", "directed": "{d}",
                       "for": {"i": [0], "n": [2], "d": [False]}},
                      {"a": "g1", "b": "sw", "bandwidth": "10 GB/s", "count": "{n}", "for": {"n": [3]}}],
            "ranks": ["g0", "g1"]}
    topo = Topology.from_dict(data)
    assert [(link.count, link.directed) for link in topo.links] == [(2, False), (3, False)]
    assert all(type(link.count) is int and type(link.directed) is bool for link in topo.links)
    data["links"][1]["for"] = {"n": ["two"]}
    err = load_error(tmp_path, data)
    assert err.entry == "links[1] (n=two)" and "count must be a whole number >= 1" in str(err)


def test_shipped_style_for_file_loads(tmp_path):
    text = textwrap.dedent("""\
        name: cube
        defaults: {latency: 1 us}
        nodes:
          - {id: box, kind: host}
          - {id: "box/gpu{g}", kind: gpu, for: {g: 4}}
          - {id: box/pcie, kind: pcie}
        links:
          - {a: "box/gpu{p[0]}", b: "box/gpu{p[1]}", bandwidth: 25 GB/s, count: 2,
             for: {p: [[0, 1], [2, 3]]}}
          - {a: "box/gpu{g}", b: box/pcie, bandwidth: 12 GB/s, for: {g: 4}}
        ranks:
          - {id: "box/gpu{g}", for: {g: 4}}
        """)
    topo = Topology.load(write(tmp_path, text))
    assert topo.capacity("box/gpu2", "box/gpu3") == pytest.approx(50e9)
    assert topo.hosts == {"box": (0, 1, 2, 3)}


# -------------------------------------------------------------------------------- hierarchy form

def test_hierarchy_three_tiers():
    topo = Topology.from_dict({"name": "ibm", "tiers": [
        {"name": "gpu", "count": 4, "bandwidth": "150 GB/s", "latency": "1 us"},
        {"name": "host", "count": 16, "bandwidth": "100 Gbit/s"},
        {"name": "rack", "count": 3, "bandwidth": "400 Gbit/s", "latency": "5 us"}]})
    assert topo.nranks == 192
    assert len(topo.nodes) == 1 + 3 + 48 + 192
    assert topo.ranks[:5] == ("r0/h0/gpu0", "r0/h0/gpu1", "r0/h0/gpu2", "r0/h0/gpu3", "r0/h1/gpu0")
    assert topo.ranks[-1] == "r2/h15/gpu3"
    assert topo.kind("spine") == "switch" and topo.kind("r1") == "switch"
    assert topo.kind("r1/h3") == "host" and topo.kind("r1/h3/gpu2") == "gpu"
    assert topo.capacity("r1/h3/gpu2", "r1/h3") == pytest.approx(150e9)
    assert topo.capacity("r1/h3", "r1") == pytest.approx(12.5e9)
    assert topo.capacity("spine", "r2") == pytest.approx(50e9)
    assert topo.latency("r2", "spine") == pytest.approx(5e-6)
    assert topo.latency("r1/h3", "r1") == pytest.approx(1e-6)
    assert len(topo.links) == 3 + 48 + 192
    assert len(topo.hosts) == 48 and topo.hosts["r1/h0"] == (64, 65, 66, 67)
    assert topo.host_of(191) == "r2/h15"
    assert [(t.bandwidth, len(t.groups)) for t in topo.tiers] == [(150e9, 48), (12.5e9, 1)]


def test_hierarchy_two_tiers_with_kind_and_ranks():
    topo = Topology.from_dict({"name": "flat", "defaults": {"latency": "2 us"}, "tiers": [
        {"count": 2, "bandwidth": "20 GB/s", "kind": "cpu"}, {"count": 3, "bandwidth": "1 GB/s"}],
        "ranks": [{"id": "h{h}/cpu0", "for": {"h": 3}}]})
    assert set(topo.nodes) == {"spine", "h0", "h1", "h2", "h0/cpu0", "h0/cpu1", "h1/cpu0", "h1/cpu1",
                               "h2/cpu0", "h2/cpu1"}
    assert topo.kind("h2/cpu1") == "cpu" and topo.kind("h2") == "host"
    assert topo.ranks == ("h0/cpu0", "h1/cpu0", "h2/cpu0")
    assert topo.capacity("h1", "spine") == pytest.approx(1e9)
    assert topo.latency("h1", "spine") == pytest.approx(2e-6)
    assert topo.hosts == {"h0": (0,), "h1": (1,), "h2": (2,)}
    assert topo.tiers[-1].groups == ((0, 1, 2),)


@pytest.mark.parametrize("tiers, hosts", [(2, ["r0/h0", "r0/h1", "r1/h0", "r1/h1"]),
                                          (3, ["p0/r0/h0", "p0/r0/h1", "p0/r1/h0", "p0/r1/h1", "p1/r0/h0",
                                               "p1/r0/h1", "p1/r1/h0", "p1/r1/h1"])])
def test_hierarchy_of_host_ranks_puts_them_in_switches(tiers, hosts):
    """Ranks that are whole hosts (`kind: host`) hang from racks (and pods): one rank per host, not hosts
    grouped into hosts (the two-tier form once made its racks two hosts of two ranks)."""
    topo = Topology.from_dict({"name": "t", "tiers": [{"count": 2, "bandwidth": "1 GB/s", "kind": "host"}]
                               + [{"count": 2, "bandwidth": "1 GB/s"}] * (tiers - 1)})
    assert topo.ranks == tuple(hosts)
    assert topo.hosts == {h: (i,) for i, h in enumerate(hosts)}
    assert all(topo.kind(h) == "host" for h in hosts)
    assert {topo.kind(v) for v in topo.nodes if v not in hosts} == {"switch"}
    assert topo.capacity("r1/h0" if tiers == 2 else "p1/r0/h1", "r1" if tiers == 2 else "p1/r0") == pytest.approx(1e9)


def test_hierarchy_to_dict_is_explicit_and_equal():
    topo = Topology.from_dict({"name": "t", "tiers": [{"count": 2, "bandwidth": "20 GB/s"},
                                                      {"count": 2, "bandwidth": "1 GB/s"}]})
    data = topo.to_dict()
    assert "tiers" not in data and len(data["nodes"]) == 7
    assert Topology.from_dict(data) == topo


# --------------------------------------------------------------------------- JSON and round trips

def test_json_equals_yaml(tmp_path):
    from_yaml = Topology.load(write(tmp_path, MINI_YAML))
    from_json = Topology.load(write(tmp_path, mini(), "topo.json"))
    assert from_json == from_yaml
    assert from_json.fingerprint == from_yaml.fingerprint
    assert from_json.source.endswith("topo.json")


@pytest.mark.parametrize("name", ["out.yaml", "out.json"])
def test_dump_load_round_trip(tmp_path, name):
    data = mini()
    data["defaults"] = {"reduce_bandwidth": "20 GB/s", "latency": "2 us", "message_cost": "3 us"}
    data["nodes"][2]["reduce_bandwidth"] = "1 TB/s"
    data["nodes"][3]["host"] = "h0"
    data["links"].append({"a": "sw", "b": "h0", "bandwidth": 1e9 / 3, "latency": 1.2345e-7, "directed": True})
    topo = Topology.from_dict(data)
    path = tmp_path / name
    topo.dump(path)
    back = Topology.load(path)
    assert back == topo and hash(back) == hash(topo)
    assert back.fingerprint == topo.fingerprint
    assert back.to_dict() == topo.to_dict()
    assert back.links[-1].bandwidth == topo.links[-1].bandwidth == pytest.approx(1e9 / 3, rel=1e-11)
    last = topo.to_dict()["links"][-1]  # values are kept to 12 significant digits
    assert (last["bandwidth"], last["latency"], last["directed"]) == ("333.333333333 MB/s", "123.45 ns", True)
    assert back.reduce_bandwidth(0) == 1e12 and back.reduce_bandwidth(1) == 20e9
    assert back.message_cost == pytest.approx(3e-6) and topo.to_dict()["defaults"]["message_cost"] == "3 us"
    if name.endswith(".json"):
        assert json.loads(path.read_text())["name"] == "mini"
    else:
        assert "25 GB/s" in path.read_text()


def test_message_cost_is_a_duration_that_changes_the_fingerprint():
    plain = Topology.from_dict(mini())
    assert plain.message_cost == 0.0 and "defaults" not in plain.to_dict()
    costly = Topology.from_dict({**mini(), "defaults": {"message_cost": "5 us"}})
    assert costly.message_cost == pytest.approx(5e-6) and costly.fingerprint != plain.fingerprint
    # zero is the same fabric as none given
    assert Topology.from_dict({**mini(), "defaults": {"message_cost": 0}}) == plain
    for bad, says in (("-1 us", "must be zero or positive"), ("5 GB/s", "cannot read message_cost"),
                      (float("inf"), "must be zero or positive"),
                      ("1e308 s", r"message_cost '1e308 s' is outside what ddl plans for \(0 to 60 s\)")):
        with pytest.raises(TopologyError, match=says) as err:
            Topology.from_dict({**mini(), "defaults": {"message_cost": bad}})
        assert "defaults" in str(err.value) and "e.g. '2 us'" in str(err.value)


def test_to_dict_uses_readable_units():
    data = Topology.from_dict(mini()).to_dict()
    assert data["links"][0] == {"a": "h0/gpu0", "b": "h0/gpu1", "bandwidth": "25 GB/s", "latency": "3 us",
                                "count": 2}
    assert data["links"][3]["bandwidth"] == "12.5 GB/s"


def test_spelling_does_not_change_the_fingerprint():
    a = Topology.from_dict(pair("100 Gbit/s"))
    b = Topology.from_dict(pair("12.5 GB/s", latency="1000 ns"))
    assert a == b and a.fingerprint == b.fingerprint
    assert a != Topology.from_dict(pair("12 GB/s"))


def shipped_files():
    return sorted((REPO / "topologies").glob("*.yaml")) + sorted((REPO / "topologies").glob("*.json"))


@pytest.mark.parametrize("path", shipped_files(), ids=lambda p: p.name)
def test_shipped_topologies_load_and_round_trip(path, tmp_path):
    topo = Topology.load(path)
    assert topo.nranks >= 1
    topo.dump(tmp_path / "again.yaml")
    assert Topology.load(tmp_path / "again.yaml") == topo


# ------------------------------------------------------------------------------------- bad input

def test_yaml_syntax_error_gives_line(tmp_path):
    err = load_error(tmp_path, MINI_YAML.replace("{id: h0, kind: host}", "{id: h0, kind: host"))
    assert "YAML syntax error at line 5" in str(err)  # where the parser finds the missing brace
    assert "indentation" in str(err)
    err = load_error(tmp_path, MINI_YAML.replace("name: mini", "name: mini: x"))
    assert "YAML syntax error at line 1, column 11" in str(err)


def test_json_syntax_error_gives_line(tmp_path):
    err = load_error(tmp_path, '{"name": "x",\n "nodes": [}\n', "bad.json")
    assert "JSON syntax error at line 2" in str(err)


def test_duplicate_yaml_key(tmp_path):
    err = load_error(tmp_path, MINI_YAML.replace("{id: sw, kind: switch}", "{id: sw, kind: switch, id: s}"))
    assert "'id' is given twice" in str(err) and "line 3" in str(err)


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    err = load_error(tmp_path, text)
    assert "empty" in str(err) and "nodes, links and ranks" in str(err)


def test_missing_file_is_a_topology_error(tmp_path):
    with pytest.raises(TopologyError, match="no such file") as info:
        Topology.load(tmp_path / "nothere.yaml")
    assert "nothere.yaml" in str(info.value)


def test_only_a_regular_file_of_bounded_size_is_read(tmp_path, monkeypatch):
    """A FIFO blocked the reader and /dev/zero filled its memory; an empty path read as the folder '.'."""
    import os
    import ddl.topology_file as topology_file
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path, says in ((fifo, "is a FIFO (named pipe), not a regular file"),
                       ("/dev/zero", "is a character device, not a regular file"),
                       ("", "no file named (the path is empty)"),
                       (tmp_path, "is a directory")):
        with pytest.raises(TopologyError, match=re.escape(says)) as info:
            Topology.load(path)
        assert str(info.value).startswith(f"{path}: " if str(path) else "no file named")
    big = tmp_path / "big.yaml"
    big.write_text(MINI_YAML)
    monkeypatch.setattr(topology_file, "MAX_FILE_BYTES", big.stat().st_size - 1)
    with pytest.raises(TopologyError, match=r"big.yaml: is \d+ B, and topology files are read up to \d+ B"):
        Topology.load(big)
    monkeypatch.setattr(topology_file, "MAX_FILE_BYTES", big.stat().st_size)
    assert Topology.load(big).nranks > 0


@pytest.mark.parametrize("template,says", [
    ("h{i:>1000000000}", "asks for a field of 1000000000 characters; at most 64"),   # (a gigabyte per entry)
    ("h{i.__class__.__name__}{i}", "reads an attribute"),
    ("h{i:{i}}", "is itself a template")])
def test_templates_may_not_read_attributes_or_ask_for_huge_fields(tmp_path, template, says):
    text = ("name: t\nnodes:\n  - {id: sw, kind: switch}\n  - {id: '%s', kind: host, for: {i: 2}}\n"
            "links: []\nranks: []\n" % template)
    err = load_error(tmp_path, text)
    assert f"nodes[1]: template {template!r}: " in str(err) and says in str(err), str(err)


def test_a_second_yaml_document_is_named_as_such(tmp_path):
    err = load_error(tmp_path, MINI_YAML + "---\nname: other\n")
    line = MINI_YAML.count("\n") + 1
    assert f"a second YAML document begins at line {line}, column 1" in str(err) and "remove the '---'" in str(err)


def test_top_level_must_be_a_mapping(tmp_path):
    err = load_error(tmp_path, "- a\n- b\n")
    assert "top level must be a mapping" in str(err)


def test_missing_section(tmp_path):
    data = mini()
    del data["links"]
    err = load_error(tmp_path, data)
    assert "missing section links" in str(err) and "name, nodes, links and ranks" in str(err)


def test_missing_name(tmp_path):
    data = mini()
    del data["name"]
    err = load_error(tmp_path, data)
    assert err.entry == "name" and "missing key 'name'" in str(err)


@pytest.mark.parametrize("section,value", [("nodes", {"sw": "switch"}), ("links", "none"), ("ranks", 3)])
def test_section_of_wrong_type(tmp_path, section, value):
    data = mini()
    data[section] = value
    err = load_error(tmp_path, data)
    assert err.entry == section and f"{section} must be a list (e.g." in str(err)


def test_unknown_node_in_link_suggests_close_ids(tmp_path):
    data = mini()
    data["links"][2]["a"] = "h0/gpu2"
    err = load_error(tmp_path, data)
    assert err.entry == "links[2]"
    assert "link end a 'h0/gpu2' names no node" in str(err)
    assert "did you mean 'h0/gpu1' or 'h0/gpu0'" in str(err) and "add it to nodes" in str(err)


def test_error_in_expanded_entry_names_the_repetition(tmp_path):
    data = mini()
    data["links"].append({"a": "h0/gpu{i}", "b": "sw", "bandwidth": "1 GB/s", "for": {"i": 3}})
    err = load_error(tmp_path, data)
    assert err.entry == "links[4] (i=2)"
    assert "links[4] (i=2): link end a 'h0/gpu2' names no node" in str(err)


def test_duplicate_node_id(tmp_path):
    data = mini()
    data["nodes"].append({"id": "h0", "kind": "switch"})
    err = load_error(tmp_path, data)
    assert err.entry == "nodes[4]" and "already defined by nodes[1]" in str(err) and "unique" in str(err)


def test_unknown_kind(tmp_path):
    data = mini()
    data["nodes"][0]["kind"] = "swtich"
    err = load_error(tmp_path, data)
    assert err.entry == "nodes[0]" and "did you mean 'switch'" in str(err)


def test_self_loop(tmp_path):
    data = mini()
    data["links"][3]["b"] = "h0"
    err = load_error(tmp_path, data)
    assert err.entry == "links[3]" and "connects 'h0' to itself" in str(err) and "fix a or b" in str(err)


@pytest.mark.parametrize("bandwidth", ["0 GB/s", "-5 GB/s", 0, -1.0])
def test_non_positive_bandwidth(tmp_path, bandwidth):
    data = mini()
    data["links"][1]["bandwidth"] = bandwidth
    err = load_error(tmp_path, data)
    assert err.entry == "links[1]" and "must be positive" in str(err) and "e.g. '25 GB/s'" in str(err)


@pytest.mark.parametrize("bandwidth", ["fast", "25 GX/s", "25 GB", None, True])
def test_unparseable_bandwidth_or_unknown_unit(tmp_path, bandwidth):
    data = mini()
    data["links"][1]["bandwidth"] = bandwidth
    err = load_error(tmp_path, data)
    assert err.entry == "links[1]" and "cannot read bandwidth" in str(err) and "Gbit/s" in str(err)


def test_missing_bandwidth(tmp_path):
    data = mini()
    del data["links"][1]["bandwidth"]
    err = load_error(tmp_path, data)
    assert err.entry == "links[1]" and "missing key 'bandwidth'" in str(err)


@pytest.mark.parametrize("latency", ["soon", "1 GB/s", "-1 us"])
def test_bad_latency(tmp_path, latency):
    data = mini()
    data["links"][0]["latency"] = latency
    err = load_error(tmp_path, data)
    assert err.entry == "links[0]" and "latency" in str(err) and "'2 us'" in str(err)


@pytest.mark.parametrize("count", [0, -2, 1.5, "two", True])
def test_bad_count(tmp_path, count):
    data = mini()
    data["links"][0]["count"] = count
    err = load_error(tmp_path, data)
    assert err.entry == "links[0]" and "count must be a whole number >= 1" in str(err)


def test_directed_must_be_boolean(tmp_path):
    err = load_error(tmp_path, pair(directed="yes please"))
    assert err.entry == "links[0]" and "true or false" in str(err)


@pytest.mark.parametrize("section,index,key,suggestion", [
    ("links", 1, "bandwith", "bandwidth"), ("links", 0, "lat", "latency"), ("nodes", 2, "knd", "kind")])
def test_unknown_key_suggests_closest(tmp_path, section, index, key, suggestion):
    data = mini()
    data[section][index][key] = "x"
    err = load_error(tmp_path, data)
    assert err.entry == f"{section}[{index}]"
    assert f"unknown key {key!r} (did you mean {suggestion!r}?)" in str(err)


def test_unknown_top_level_key(tmp_path):
    data = mini()
    data["rank"] = []
    err = load_error(tmp_path, data)
    assert "unknown key 'rank' (did you mean 'ranks'" in str(err)


def test_rank_listed_twice(tmp_path):
    data = mini()
    data["ranks"].append("h0/gpu0")
    err = load_error(tmp_path, data)
    assert err.entry == "ranks[2]" and "already rank 0" in str(err) and "once" in str(err)


def test_rank_naming_no_node(tmp_path):
    data = mini()
    data["ranks"][1] = "h0/gpu7"
    err = load_error(tmp_path, data)
    assert err.entry == "ranks[1]" and "'h0/gpu7' names no node" in str(err) and "did you mean" in str(err)


def test_empty_ranks(tmp_path):
    data = mini()
    data["ranks"] = []
    err = load_error(tmp_path, data)
    assert "ranks is empty" in str(err)


def test_unreachable_ranks_name_a_pair(tmp_path):
    data = mini()
    data["nodes"].append({"id": "lonely", "kind": "gpu"})
    data["ranks"].append("lonely")
    err = load_error(tmp_path, data)
    assert err.entry == "ranks"
    assert "rank 0 (h0/gpu0) cannot reach rank 2 (lonely)" in str(err) and "add a link" in str(err)


def test_ranks_cannot_relay_through_a_gpu(tmp_path):
    # g0 - g1 - g2 in a line of NVLinks, no switch: g0 and g2 could only talk through g1
    data = {"name": "line", "nodes": [{"id": "g{i}", "kind": "gpu", "for": {"i": 3}}],
            "links": [{"a": "g0", "b": "g1", "bandwidth": "1 GB/s"}, {"a": "g1", "b": "g2", "bandwidth": "1 GB/s"}],
            "ranks": ["g0", "g1", "g2"]}
    err = load_error(tmp_path, data)
    assert "rank 0 (g0) cannot reach rank 2 (g2)" in str(err)
    assert Topology.from_dict({**data, "ranks": ["g0", "g1"]}).nranks == 2


def test_one_way_only_is_unreachable(tmp_path):
    data = pair()
    data["links"][1]["directed"] = True  # g1 -> sw only
    err = load_error(tmp_path, data)
    assert "rank 0 (g0) cannot reach rank 1 (g1)" in str(err)


@pytest.mark.parametrize("spec,fragment", [
    ({"i": -1}, "not a count >= 1"), ({"i": []}, "not a count >= 1"), ({"i": "4"}, "not a count >= 1"),
    ([4], "non-empty mapping"), ({}, "non-empty mapping"), ({"1x": 2}, "not a valid name")])
def test_bad_for_values(tmp_path, spec, fragment):
    data = mini()
    data["nodes"].append({"id": "x{i}", "kind": "gpu", "for": spec})
    err = load_error(tmp_path, data)
    assert err.entry == "nodes[4]" and fragment in str(err) and "for: {i: 4, j: [0, 2]}" in str(err)


def test_for_with_an_absurd_count_fails_fast(tmp_path):
    data = mini()
    data["links"].append({"a": "x{i}", "b": "x{j}", "bandwidth": "1 GB/s", "for": {"i": 100000, "j": 100000}})
    t0 = time.perf_counter()
    err = load_error(tmp_path, data)
    assert time.perf_counter() - t0 < 5      # refused before anything is expanded
    assert err.entry == "links[4]" and "repeats this entry 10000000000 times; at most 1048576" in str(err)
    assert "i: 100000, j: 100000" in str(err)


def test_for_template_with_unknown_variable(tmp_path):
    data = mini()
    data["nodes"].append({"id": "x{k}", "kind": "gpu", "for": {"i": 2}})
    err = load_error(tmp_path, data)
    assert err.entry == "nodes[4]" and "uses {k}, which is not a for: variable (have i)" in str(err)


def test_defaults_unknown_key(tmp_path):
    data = mini()
    data["defaults"] = {"latncy": "1 us"}
    err = load_error(tmp_path, data)
    assert err.entry == "defaults" and "did you mean 'latency'" in str(err)


def tiered(*tiers):
    return {"name": "t", "tiers": list(tiers)}


@pytest.mark.parametrize("data,entry,fragment", [
    (tiered({"count": 4, "bandwidth": "1 GB/s"}), "tiers", "2 or 3 tiers"),
    (tiered({"count": 4, "bandwidth": "1 GB/s"}), "tiers", "Gbit/s}], not 1"),
    (tiered(*[{"count": 2, "bandwidth": "1 GB/s"}] * 4), "tiers", "Gbit/s}], not 4"),
    ({"name": "t", "tiers": {"gpu": 4}}, "tiers", "2 or 3 tiers"),
    (tiered({"count": 4, "bandwidth": "1 GB/s"}, {"count": 0, "bandwidth": "1 GB/s"}), "tiers[1]",
     "count must be a whole number >= 1"),
    (tiered({"count": 4, "bandwidth": "1 GB/s"}, {"count": 2}), "tiers[1]", "missing key 'bandwidth'"),
    (tiered({"count": 4, "bandwidth": "1 GB/s"}, {"count": 2, "bandwith": "1 GB/s"}), "tiers[1]",
     "did you mean 'bandwidth'"),
    (tiered({"count": 4, "bandwidth": "0 GB/s"}, {"count": 2, "bandwidth": "1 GB/s"}), "tiers[0]",
     "must be positive"),
    (tiered({"count": 4, "bandwidth": "1 GB/s"}, {"count": 2, "bandwidth": "1 GB/s", "kind": "cpu"}),
     "tiers[1]", "only to the first"),
    (tiered({"count": 4, "bandwidth": "1 GB/s", "kind": "switch"}, {"count": 2, "bandwidth": "1 GB/s"}),
     "tiers[0]", "the first tier's nodes are the ranks, which run on a gpu, cpu or host node"),
    (tiered("gpu", {"count": 2, "bandwidth": "1 GB/s"}), "tiers[0]", "a tier is a mapping"),
    ({**tiered({"count": 1, "bandwidth": "1 GB/s"}, {"count": 2, "bandwidth": "1 GB/s"}), "nodes": []},
     "tiers", "replaces nodes and links"),
])
def test_bad_tiers(tmp_path, data, entry, fragment):
    err = load_error(tmp_path, data)
    assert err.entry == entry and fragment in str(err)


def test_from_dict_errors_name_dict_source():
    with pytest.raises(TopologyError, match=r"^<dict>: links\[0\]: ") as info:
        Topology.from_dict(pair("slow"))
    assert info.value.source == "<dict>"
    with pytest.raises(TopologyError, match=r"^cfg: links\[0\]: "):
        Topology.from_dict(pair("slow"), source="cfg")


def test_input_dict_is_not_modified():
    data = {"name": "t", "nodes": [{"id": "g{i}", "kind": "gpu", "for": {"i": 2}}, {"id": "s", "kind": "switch"}],
            "links": [{"a": "g{i}", "b": "s", "bandwidth": "1 GB/s", "for": {"i": 2}}], "ranks": ["g0", "g1"]}
    before = copy.deepcopy(data)
    Topology.from_dict(data)
    assert data == before


def test_absurd_sizes_fail_fast_with_the_entry_named(tmp_path):
    started = time.perf_counter()
    tiers = {"name": "t", "tiers": [{"name": "gpu", "count": 10 ** 9, "bandwidth": "10 GB/s"},
                                    {"name": "host", "count": 1, "bandwidth": "1 GB/s"}]}
    with pytest.raises(TopologyError, match=r"tiers: the tiers make 1000000000 ranks .* at most 1048576"):
        Topology.from_dict(tiers)
    with pytest.raises(TopologyError, match=r"links\[0\]: cannot read bandwidth"):
        Topology.from_dict(pair(bandwidth=10 ** 400))                         # beyond a float
    with pytest.raises(TopologyError, match=r"links\[0\]: count 1000000000000 of .* at most 1048576"):
        Topology.from_dict(pair(count=10 ** 12))
    with pytest.raises(TopologyError, match=r"links\[0\]: bandwidth 1e\+305 is outside what ddl plans for"):
        Topology.from_dict(pair(bandwidth=1e305, count=10 ** 6))
    with pytest.raises(TopologyError, match=r"links\[0\]: bandwidth 1e-300 is outside what ddl plans for \(1 B/s"):
        Topology.from_dict(pair(bandwidth=1e-300))                           # times would overflow
    with pytest.raises(TopologyError, match=r"links\[0\]: latency '61 s' is outside what ddl plans for \(0 to 60"):
        Topology.from_dict(pair(latency="61 s"))          # (1e308 s planned as a deadlock naming no file)
    assert Topology.from_dict(pair(latency="60 s")).nranks == 2
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(TopologyError, match="nested too deeply"):
        Topology.load(deep)
    # YAML as deep crashed the process inside libyaml; now the entry's line is named, flow or block style
    for i, text in enumerate(("name: x\nnodes: " + "[" * 100000 + "]" * 100000,
                              "name: x\nnodes:\n" + "- " * 100000 + "a")):
        deep = tmp_path / f"deep{i}.yaml"
        deep.write_text(text)
        with pytest.raises(TopologyError, match=r"deep\d.yaml: YAML nested more than 100 levels deep at line \d"):
            Topology.load(deep)
    assert time.perf_counter() - started < 10


def test_a_host_attribute_names_a_host_node_or_a_host_of_its_own():
    data = pair()
    data["nodes"][1]["host"] = "box-7"                                # a machine the file does not model
    assert Topology.from_dict(data).host_of(0) == "box-7"
    data["nodes"] += [{"id": "h0", "kind": "host"}, {"id": "h1", "kind": "host"}]
    data["nodes"][1]["host"] = "h9"      # where the file has host nodes, a typo would split a machine in two
    with pytest.raises(TopologyError, match=r"nodes\[1\]: host 'h9' names no node \(did you mean 'h[01]' or 'h[01]'\?\); "
                                            r"this file has host nodes, so name one of them \(h0, h1\)"):
        Topology.from_dict(data)
    data["nodes"][1]["host"] = "sw"
    with pytest.raises(TopologyError, match=r"nodes\[1\]: host 'sw' is a switch node; name a node of kind host"):
        Topology.from_dict(data)
    data["nodes"][1]["host"] = "h0"
    with pytest.warns(UserWarning, match=r"1 node \(h1; first at nodes\[4\]\) has no link"):     # h0 is named
        assert Topology.from_dict(data).hosts


def test_numbers_yaml_reads_as_text_say_so_and_a_json_byte_order_mark_is_no_error(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(pair()).replace("10 GB/s", "1e10"))     # YAML 1.1: 1e10 is a string
    with pytest.raises(TopologyError, match=r"YAML's 1e9 without a dot, is text: add the unit, e.g. 1e10 B/s"):
        Topology.load(path)
    path.write_text(yaml.safe_dump(pair()).replace("10 GB/s", "1e10 B/s"))
    assert Topology.load(path).links[0].bandwidth == 1e10
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(pair()).encode())
    assert Topology.load(bom) == Topology.from_dict(pair())


def test_a_character_yaml_refuses_is_named_with_its_line(tmp_path):
    path = tmp_path / "nul.yaml"
    path.write_bytes(b"name: x\nnodes: []\x00\n")
    with pytest.raises(TopologyError, match=r"nul.yaml: character '\\x00' at line 2, column 10 is not allowed in YAML"):
        Topology.load(path)


def test_a_rank_on_a_switch_nic_or_pcie_node_is_refused_by_name():
    """Those vertices forward data and run no process; a rank there would silently stop forwarding."""
    for kind in ("switch", "nic", "pcie"):
        data = pair()
        data["nodes"].append({"id": "x", "kind": kind})
        data["links"].append({"a": "x", "b": "sw", "bandwidth": "10 GB/s"})
        data["ranks"] = ["g0", "x"]
        with pytest.raises(TopologyError, match=rf"ranks\[1\]: rank 'x' is a {kind} node, which runs no process; "
                                                r"a rank is a gpu, cpu or host node"):
            Topology.from_dict(data)
    tiers = {"name": "t", "tiers": [{"name": "gpu", "count": 2, "bandwidth": "10 GB/s"},
                                    {"name": "host", "count": 2, "bandwidth": "1 GB/s"}], "ranks": ["spine", "h0"]}
    with pytest.raises(TopologyError, match="rank 'spine' is a switch node"):
        Topology.from_dict(tiers)


def test_wrong_values_are_shown_short_and_built_short(tmp_path):
    """A few hundred bytes of YAML aliases stand for gigabytes of nested lists (9 levels of 9: 387
    million strings): describing the wrong value took 15 s and 760 MB at 8 levels and ran out of
    memory at 9. Another format read as YAML (NCCL's topology XML) was echoed whole."""
    levels = ['&a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"name: [{', '.join(levels)}]\nnodes: []\nlinks: []\nranks: []\n")
    start = time.perf_counter()
    with pytest.raises(TopologyError, match=r"name must be a non-empty string, not a list \(\[\[") as info:
        Topology.load(bomb)
    assert time.perf_counter() - start < 5 and len(str(info.value)) < 250
    xml = tmp_path / "nccl.xml"
    xml.write_text('<system version="1">\n' + '  <cpu numaid="0" affinity="ff" arch="x86_64">\n' * 200 + "</system>\n")
    with pytest.raises(TopologyError, match="this is NCCL's topology XML, not a topology file: make one from it "
                                            "with `ddl topo import") as info:
        Topology.load(xml)
    assert len(str(info.value)) < 400
    graphs = tmp_path / "graph.xml"      # NCCL_GRAPH_DUMP_FILE's rings and trees: read as a YAML string
    graphs.write_text('<graphs version="1">\n' + '  <graph id="0" pattern="4" crossnic="0" nchannels="2">\n' * 200)
    with pytest.raises(TopologyError, match="the top level must be a mapping") as info:
        Topology.load(graphs)
    assert len(str(info.value)) < 400 and "ddl topo import" in str(info.value)

"""Reading, validating and expanding topology files.

A topology file (YAML; JSON when its name ends in ``.json``) comes in three shapes that all end up in
one *explicit form*, a :class:`Spec`:

* explicit: ``name``, ``nodes``, ``links``, ``ranks`` (optional ``defaults``, ``description``);
* with repetition: any entry of ``nodes``, ``links`` or ``ranks`` may carry ``for: {i: 4, j: [0, 2]}``
  and is then repeated over the product of the values (first variable slowest), every string in it
  being a :meth:`str.format` template over the variables;
* the hierarchy form (IBM DDL's X x Y x Z): ``tiers`` instead of ``nodes``/``links``.

Everything a user can get wrong raises :class:`~ddl.errors.TopologyError` naming the file, the entry
(``links[3]``, or ``links[3] (i=2, j=5)`` for one repetition of a ``for:`` entry) and how to fix it,
because the person editing a YAML file should never need a Python traceback. Checks that need the
graph (ranks reaching each other) live in :mod:`ddl.topology`.

Units inside a Spec: bytes/s, seconds.
"""
import difflib
import functools
import itertools
import json
import math
import os
import pathlib
import re
import reprlib
import string
import warnings
from collections import namedtuple

import yaml

from .errors import TopologyError
from .schedule import file_kind
from .units import (BANDWIDTH_PS, BANDWIDTH_UNITS, LATENCY_UNITS, counted, format_size, missing_unit_hint, parse_bandwidth,
                    parse_latency, whole_number)

KINDS = ("gpu", "cpu", "nic", "switch", "host", "pcie")
RANK_KINDS = ("gpu", "cpu", "host")     # what a rank (a process) can run on; the others only forward
_RANK_NODE = f"a {', '.join(RANK_KINDS[:-1])} or {RANK_KINDS[-1]} node"     # (in messages)
MIN_BANDWIDTH, MAX_BANDWIDTH = 1.0, 1e18     # bytes/s: 1 B/s to 1 EB/s (beyond, times over- or underflow)
# Latencies and message costs up to a minute, far beyond any fabric's (1e308 s overflowed the simulator
# into a "deadlock" that named no file).
MAX_DURATION = 60.0
DEFAULT_LATENCY = 1e-6  # seconds, when neither the link nor the file's defaults give one

TOP_KEYS = ("name", "description", "defaults", "nodes", "links", "ranks", "tiers")
DEFAULT_KEYS = ("latency", "reduce_bandwidth", "message_cost")
NODE_KEYS = ("id", "kind", "host", "reduce_bandwidth")
LINK_KEYS = ("a", "b", "bandwidth", "latency", "count", "directed")
RANK_KEYS = ("id",)
TIER_KEYS = ("name", "count", "bandwidth", "latency", "kind")

# (id prefix, kind) of the nodes each tier of the hierarchy form creates, innermost first, by the first
# tier's kind: GPU or CPU ranks in hosts in racks, or hosts in racks in pods where the ranks are hosts
_TIER_NODES = {"gpu": (("gpu", "gpu"), ("h", "host"), ("r", "switch")),
               "cpu": (("cpu", "cpu"), ("h", "host"), ("r", "switch")),
               "host": (("h", "host"), ("r", "switch"), ("p", "switch"))}
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NVIDIA_SMI_ROW = re.compile(r"^GPU0[ \t]+X[ \t]", re.M)   # the first row of `nvidia-smi topo -m`


class Link(namedtuple("Link", "a b bandwidth latency count directed")):
    """One link entry: ``count`` parallel links of ``bandwidth`` bytes/s each way (a -> b only when
    ``directed``), ``latency`` seconds. Normalized links always carry a float latency."""

    __slots__ = ()

    def __new__(cls, a, b, bandwidth, latency=None, count=1, directed=False):
        return super().__new__(cls, a, b, bandwidth, latency, count, directed)


Spec = namedtuple("Spec", "name description defaults nodes links ranks source")
Spec.__doc__ = """A validated topology in explicit form.

``nodes`` is a tuple of ``(id, kind, attrs)`` with attrs a dict (``host``, ``reduce_bandwidth``),
``links`` a tuple of :class:`Link`, ``ranks`` a tuple of vertex ids, ``defaults`` a dict of floats,
``source`` the file path or None."""


# ----------------------------------------------------------------------------------------- reading

# The largest topology file read: an explicit file of 100 000 links takes about 10 MB.
MAX_FILE_BYTES = 256 << 20


def load(path):
    """Read, expand and validate the topology file at ``path``; return its :class:`Spec`."""
    return parse(read(path), source=str(path))


def read(path):
    """Parse the file at ``path`` (JSON for ``*.json``, YAML otherwise) into plain Python data.

    Only a regular file of at most :data:`MAX_FILE_BYTES` is read: a FIFO would block the reader,
    and ``/dev/zero`` would fill its memory."""
    source = str(path)
    if not source.strip():
        raise TopologyError("no file named (the path is empty): give the path of a .yaml or .json topology file")
    kind = file_kind(source)
    if kind is not None and kind != "a folder":
        raise TopologyError(f"is {kind}, not a regular file: give the path of a .yaml or .json topology file",
                            source)
    try:
        size = os.stat(source).st_size
    except OSError:
        size = 0           # (reading it says why)
    if size > MAX_FILE_BYTES:
        raise TopologyError(f"is {format_size(size)}, and topology files are read up to "
                            f"{format_size(MAX_FILE_BYTES)}: is it the right file? (a cluster's file describes "
                            f"its nodes with 'for:' templates or 'tiers', see the README)", source)
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8-sig")    # a byte-order mark is no error
    except FileNotFoundError:
        raise TopologyError("no such file; check the path (give a .yaml or .json topology file)",
                            source) from None
    except IsADirectoryError:
        raise TopologyError("is a directory; give the path of a .yaml or .json topology file",
                            source) from None
    except UnicodeDecodeError as exc:
        raise TopologyError(f"is not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8",
                            source) from None
    except OSError as exc:
        raise TopologyError(f"cannot read the file ({exc.strerror}); check its permissions",
                            source) from None
    if _NVIDIA_SMI_ROW.search(text):
        raise TopologyError("this is the output of `nvidia-smi topo -m`, not a topology file: make one from it "
                            "with `ddl topo import FILE --gpu MODEL -o cluster.yaml`, MODEL being your GPUs' (p100, "
                            "v100, a100, h100 or b200; README, \"From nvidia-smi or NCCL\")", source)
    if text.lstrip().startswith("<system"):
        raise TopologyError("this is NCCL's topology XML, not a topology file: make one from it with `ddl topo "
                            "import FILE -o cluster.yaml` (README, \"From nvidia-smi or NCCL\")", source)
    data = _parse_json(text, source) if source.lower().endswith(".json") else _parse_yaml(text, source)
    if data is None:
        raise TopologyError("the file is empty; a topology needs name, nodes, links and ranks "
                            "(or name and tiers)", source)
    return data


class _DuplicateKey(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping."""


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """Safe YAML loader (libyaml's when installed: 10x faster on cluster-sized files) that refuses a
    key given twice in one mapping; PyYAML keeps the last one silently, which would hide a typo such
    as two ``b:`` in a link."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float)):
                continue
            if key in seen:
                raise _DuplicateKey(
                    "while reading a mapping", node.start_mark,
                    f"the key {key!r} is given twice in one mapping; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_YAML_DEPTH = 100   # a topology nests a handful of levels; libyaml's composer recurses (and crashes) on 10^5


def _check_yaml_depth(text, source):
    """Refuse YAML nested deeper than MAX_YAML_DEPTH before it is composed: libyaml builds documents
    recursively in C, and ``[[[[...]]]]`` 100000 deep overflows the stack (a segfault, not an error).
    The event stream is flat, so walking it is safe, and costs a fraction of the load. Syntax errors
    are left to the load, which reports them with their line."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_UniqueKeyLoader):
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise _too_deep(event.start_mark, source)
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    except yaml.MarkedYAMLError as exc:   # newer libyaml stops deep brackets itself, while scanning ahead
        if "nesting depth" in str(exc.problem) and exc.problem_mark is not None:
            raise _too_deep(exc.problem_mark, source) from None
    except yaml.YAMLError:
        pass


def _too_deep(mark, source):
    return TopologyError(f"YAML nested more than {MAX_YAML_DEPTH} levels deep at line {mark.line + 1}, column "
                         f"{mark.column + 1}; a topology nests a few levels: check the brackets and dashes there",
                         source)


def _parse_yaml(text, source):
    _check_yaml_depth(text, source)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        if isinstance(exc, _DuplicateKey):
            raise TopologyError(f"{problem}{where}", source) from None
        if "another document" in problem:
            raise TopologyError(f"a second YAML document begins{where}: a topology file is one document; "
                                f"remove the '---' line there, or put the second topology in a file of its own",
                                source) from None
        raise TopologyError(f"YAML syntax error{where}: {problem}{_tab_hint(text, mark)}; check the "
                            f"indentation, colons and brackets there (quote strings that contain ': ', '#', "
                            f"'{{' or '[')", source) from None
    except yaml.reader.ReaderError as exc:    # a character YAML does not allow, at a position, not a line
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        raise TopologyError(f"character {char!r} at line {line}, column {column} is not allowed in "
                            f"YAML ({exc.reason}); remove it or save the file as plain text", source) from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"YAML error: {exc}", source) from None
    except ValueError as exc:      # int('9' * 5000): Python reads at most 4300 digits (sys.int_info)
        raise _too_long(exc, source) from None


def _tab_hint(text, mark):
    """YAML refuses a tab in indentation with "found character that cannot start any token", and a
    tab looks like spaces in most editors: say it is one."""
    if mark is None:
        return ""
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    if line[mark.column:mark.column + 1] != "\t":
        return ""
    return " (a tab: YAML indents with spaces only, replace the tabs with spaces)"


def _too_long(exc, source):
    """The error for a number Python refuses to read (more than 4300 digits), which both YAML and JSON
    raise as a bare ValueError, without a line."""
    return TopologyError(f"a number in the file has too many digits to read ({str(exc).split(';')[0]}); a "
                         f"topology's numbers have a few digits: check for a run of digits pasted by mistake",
                         source)


def _parse_json(text, source):
    def unique(pairs):
        keys = [k for k, _ in pairs]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise TopologyError(f"the key {twice[0]!r} is given twice in one JSON object; keep one", source)
        return dict(pairs)

    if not text.strip():
        return None
    try:
        return json.loads(text, object_pairs_hook=unique)
    except RecursionError:
        raise TopologyError("JSON nested too deeply to be a topology", source) from None
    except json.JSONDecodeError as exc:
        raise TopologyError(f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}; "
                            "check commas, quotes and brackets there", source) from None
    except TopologyError:           # a key given twice (a ValueError too)
        raise
    except ValueError as exc:       # int('9' * 5000): Python reads at most 4300 digits
        raise _too_long(exc, source) from None


def write(data, path):
    """Write plain data (an explicit-form dict) as YAML, or JSON when ``path`` ends in ``.json``."""
    path = pathlib.Path(path)
    if path.suffix.lower() == ".json":
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    else:
        text = yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False,
                         default_flow_style=None, allow_unicode=True, width=100)
    path.write_text(text, encoding="utf-8")


# -------------------------------------------------------------------------------------- validating

def parse(data, source=None):
    """Expand and validate plain data (as read from a file) into a :class:`Spec`.

    ``source`` names the file in error messages (``<dict>`` when None)."""
    where = source or "<dict>"
    if not isinstance(data, dict):
        other = (" (`ddl topo import` makes one from `nvidia-smi topo -m` or NCCL's topology XML)"
                 if isinstance(data, str) else "")
        _fail(where, None, f"the top level must be a mapping with name, nodes, links and ranks "
                           f"(or name and tiers), not {_a(data)}{other}")
    _check_keys(data, TOP_KEYS, where, None, "a topology")
    name = _string(data, "name", where, None, "the topology")
    description = _optional_string(data, "description", where)
    defaults = _defaults(data.get("defaults"), where)
    if "tiers" in data:
        mixed = [k for k in ("nodes", "links") if k in data]
        if mixed:
            _fail(where, "tiers", f"the hierarchy form (tiers) replaces nodes and links; remove "
                                  f"{' and '.join(mixed)} or remove tiers")
        nodes, links, leaves = _hierarchy(data["tiers"], where)
        ranks = _expand("ranks", data["ranks"], where) if "ranks" in data else [
            ("ranks", leaf) for leaf in leaves]
    else:
        missing = [k for k in ("nodes", "links", "ranks") if k not in data]
        if missing:
            _fail(where, None, f"missing section {', '.join(missing)}; a topology needs name, nodes, "
                               f"links and ranks (or name and tiers for the hierarchy form)")
        nodes = _expand("nodes", data["nodes"], where)
        links = _expand("links", data["links"], where)
        ranks = _expand("ranks", data["ranks"], where)
    return _normalize(name, description, defaults, nodes, links, ranks, where, source)


def build(name, nodes, links, ranks, defaults=None, source=None, description=None):
    """Validate the arguments of ``Topology(...)`` into a :class:`Spec`.

    ``nodes``: ``(id, kind)`` pairs or dicts; ``links``: :class:`Link` or dicts; ``ranks``: ids;
    ``defaults``: dict of raw values (``'1 us'``) or floats. Entries are named ``nodes[k]`` etc."""
    where = source or "<dict>"
    if not isinstance(name, str) or not name:
        _fail(where, "name", f"the name must be a non-empty string, not {_a(name)}")
    if description is not None and not isinstance(description, str):
        _fail(where, "description", f"the description must be a string, not {_a(description)}")
    sections = {"nodes": nodes, "links": links, "ranks": ranks}
    labelled = {}
    for section, items in sections.items():
        if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
            _fail(where, section, f"{section} must be a list, not {_a(items)}")
        labelled[section] = [(f"{section}[{k}]", item) for k, item in enumerate(items)]
    return _normalize(name, description, _defaults(defaults, where), labelled["nodes"],
                      labelled["links"], labelled["ranks"], where, source)


def _normalize(name, description, defaults, nodes, links, ranks, where, source):
    """Check every entry and the references between them; entries are ``(label, raw)`` pairs."""
    node_list, label_of = [], {}
    for label, entry in nodes:
        node = _node(entry, where, label)
        if node[0] in label_of:
            _fail(where, label, f"node id {node[0]!r} is already defined by {label_of[node[0]]}; "
                                f"node ids must be unique, rename or remove one")
        label_of[node[0]] = label
        node_list.append(node)
    kinds = {node_id: kind for node_id, kind, _ in node_list}
    hosts = [node_id for node_id, kind in kinds.items() if kind == "host"]
    for (label, _entry), (_id, _kind, attrs) in zip(nodes, node_list):
        host = attrs.get("host")           # a node of kind host; a label of its own where the file has none
        if host in kinds and kinds[host] != "host":
            _fail(where, label, f"host {host!r} is a {kinds[host]} node; name a node of kind host")
        if host is not None and host not in kinds and hosts:
            # a typo would split a machine in two, each half planned as a host of its own
            _fail(where, label, f"host {host!r} names no node{_did_you_mean(str(host), hosts)}; this file has "
                                f"host nodes, so name one of them ({', '.join(hosts[:6])}{', ...' if len(hosts) > 6 else ''})")
    latency = defaults.get("latency", DEFAULT_LATENCY)
    link_list = []
    for label, entry in links:
        link = _link(entry, latency, where, label)
        for end in ("a", "b"):
            _check_reference(getattr(link, end), label_of, where, label, f"link end {end}")
        link_list.append(link)
    rank_list = _ranks(ranks, label_of, where)
    for label, vertex in zip((label for label, _ in ranks), rank_list):
        if kinds[vertex] not in RANK_KINDS:
            _fail(where, label, f"rank {vertex!r} is a {kinds[vertex]} node, which runs no process; a rank is "
                                f"{_RANK_NODE}")
    _warn_loose(node_list, link_list, rank_list, label_of, where)
    return Spec(name, description, defaults, tuple(node_list), tuple(link_list), tuple(rank_list), source)


def _warn_loose(node_list, link_list, rank_list, label_of, where):
    """Warn of nodes that no link touches and no node names as its host (``host:``, or its id's prefix,
    ``dgx0`` of ``dgx0/gpu3``): they take no part in a plan, so a file that has them most likely lost
    their links (a ``for:`` that repeats a node but not its link, a deleted line). Not an error: the
    file still describes the fabric it links."""
    used = {end for link in link_list for end in (link.a, link.b)} | set(rank_list)
    used |= {attrs["host"] for _id, _kind, attrs in node_list if "host" in attrs}
    used |= {node_id[:k] for node_id, _kind, _attrs in node_list for k, c in enumerate(node_id) if c == "/"}
    loose = [node_id for node_id, _kind, _attrs in node_list if node_id not in used]
    if loose:
        shown = ", ".join(map(str, loose[:3])) + (", ..." if len(loose) > 3 else "")
        has, takes, them = ("has", "takes", "it") if len(loose) == 1 else ("have", "take", "them")
        warnings.warn(f"{where}: {counted(len(loose), 'node')} ({shown}; first at {label_of[loose[0]]}) {has} "
                      f"no link and {takes} no part in a plan: link {them} or remove {them}", stacklevel=2)


def _defaults(entry, where):
    if entry is None:
        return {}
    if not isinstance(entry, dict):
        _fail(where, "defaults", f"defaults must be a mapping such as {{latency: 1 us, reduce_bandwidth: "
                                 f"20 GB/s}}, not {_a(entry)}")
    _check_keys(entry, DEFAULT_KEYS, where, "defaults", "defaults")
    out = {}
    if entry.get("latency") is not None:
        out["latency"] = _latency(entry["latency"], where, "defaults")
    if entry.get("reduce_bandwidth") is not None:
        out["reduce_bandwidth"] = _bandwidth(entry["reduce_bandwidth"], where, "defaults", "reduce_bandwidth")
    if entry.get("message_cost") is not None:
        out["message_cost"] = _duration(entry["message_cost"], where, "defaults", "message_cost")
    return out


def _node(entry, where, label):
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        entry = {"id": entry[0], "kind": entry[1]}
    if not isinstance(entry, dict):
        _fail(where, label, f"a node is a mapping such as {{id: h0/gpu0, kind: gpu}}, not {_a(entry)}")
    _check_keys(entry, NODE_KEYS, where, label, "a node")
    node_id = _string(entry, "id", where, label, "a node")
    kind = _string(entry, "kind", where, label, "a node")
    if kind not in KINDS:
        _fail(where, label, f"unknown kind {kind!r}{_did_you_mean(kind, KINDS)}; kind is one of "
                            f"{', '.join(KINDS)}")
    attrs = {}
    if entry.get("host") is not None:
        attrs["host"] = _string(entry, "host", where, label, "a node")
    if entry.get("reduce_bandwidth") is not None:
        attrs["reduce_bandwidth"] = _bandwidth(entry["reduce_bandwidth"], where, label, "reduce_bandwidth")
    return node_id, kind, attrs


def _link(entry, default_latency, where, label):
    if isinstance(entry, Link):
        entry = entry._asdict()
    if not isinstance(entry, dict):
        _fail(where, label, f"a link is a mapping such as {{a: h0/gpu0, b: h0, bandwidth: 16 GB/s}}, "
                            f"not {_a(entry)}")
    _check_keys(entry, LINK_KEYS, where, label, "a link")
    a = _string(entry, "a", where, label, "a link")
    b = _string(entry, "b", where, label, "a link")
    if a == b:
        _fail(where, label, f"the link connects {a!r} to itself; fix a or b, or remove the link")
    if "bandwidth" not in entry:
        _fail(where, label, "missing key 'bandwidth'; add e.g. bandwidth: 25 GB/s (each way)")
    bandwidth = _bandwidth(entry["bandwidth"], where, label, "bandwidth")
    latency = entry.get("latency")
    latency = default_latency if latency is None else _latency(latency, where, label)
    count = whole_number(entry.get("count", 1))
    if count is None or count < 1:
        _fail(where, label, f"count must be a whole number >= 1 (parallel links), not {entry['count']!r}")
    if count > MAX_REPEATS or not math.isfinite(bandwidth * count):
        _fail(where, label, f"count {count} of {bandwidth:g} B/s links is more than a fabric can hold; at most "
                            f"{MAX_REPEATS} parallel links of finite total bandwidth")
    directed = entry.get("directed", False)
    if not isinstance(directed, bool):
        _fail(where, label, f"directed must be true or false, not {directed!r}")
    return Link(a, b, bandwidth, latency, count, directed)


def _ranks(entries, label_of, where):
    ranks, rank_label = [], {}
    for label, entry in entries:
        if isinstance(entry, dict):
            _check_keys(entry, RANK_KEYS, where, label, "a rank")
            vertex = _string(entry, "id", where, label, "a rank")
        elif isinstance(entry, str) and entry:
            vertex = entry
        else:
            _fail(where, label, f"a rank is a node id (string) or {{id: ..., for: ...}}, not {_a(entry)}")
        _check_reference(vertex, label_of, where, label, "rank")
        if vertex in rank_label:
            _fail(where, label, f"vertex {vertex!r} is already rank {ranks.index(vertex)} "
                                f"({rank_label[vertex]}); list each vertex once in ranks")
        rank_label[vertex] = label
        ranks.append(vertex)
    if not ranks:
        _fail(where, "ranks", "ranks is empty; list the node id of every rank, e.g. ranks: [h0/gpu0]")
    return ranks


def _check_reference(vertex, label_of, where, label, what):
    if vertex not in label_of:
        _fail(where, label, f"{what} {vertex!r} names no node{_did_you_mean(vertex, label_of)}; "
                            f"add it to nodes or fix the id")


# ------------------------------------------------------------------------------------ `for:` expansion
MAX_REPEATS = 1 << 20      # one for: entry yields at most this many (a typo like 1000000000 fails fast)


def _expand(section, entries, where):
    """``(label, entry)`` for every entry of a section, ``for:`` entries repeated."""
    if not isinstance(entries, list):
        example = {"nodes": "- {id: h0/gpu0, kind: gpu}", "links": "- {a: h0/gpu0, b: h0, bandwidth: 16 GB/s}",
                   "ranks": "[h0/gpu0, h0/gpu1]"}[section]
        _fail(where, section, f"{section} must be a list (e.g. {example}), not {_a(entries)}")
    out = []
    for k, entry in enumerate(entries):
        label = f"{section}[{k}]"
        if isinstance(entry, dict) and "for" in entry:
            out.extend(_repeat(entry, where, label))
        else:
            out.append((label, entry))
    return out


def _repeat(entry, where, label):
    """Every repetition of a ``for:`` entry, labelled ``links[3] (i=2, j=5)``."""
    names, values = _loop_variables(entry["for"], where, label)
    sizes = [v.stop if isinstance(v, range) else len(v) for v in values]   # len() of range(10**23) overflows
    count = math.prod(sizes)
    if count > MAX_REPEATS:
        _fail(where, label, f"for: repeats this entry {count} times; at most {MAX_REPEATS} (check the counts: "
                            f"{', '.join(f'{n}: {size}' for n, size in zip(names, sizes))})")
    body = {key: value for key, value in entry.items() if key != "for"}
    out = []
    for combo in itertools.product(*values):
        env = dict(zip(names, combo, strict=True))
        tag = ", ".join(f"{n}={_loop_value_text(v)}" for n, v in env.items())
        out.append((f"{label} ({tag})", _fill(body, env, where, label)))
    return out


def _loop_value_text(value):
    """A loop variable's value in a label (``p=[0, 1]``), lists and mappings cut short: a YAML alias
    there can stand for gigabytes of nested lists, which ``str`` would build whole."""
    if not isinstance(value, (list, dict)):
        return f"{value}"
    text = _SHORT.repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _loop_variables(spec, where, label):
    hint = "write for: {i: 4, j: [0, 2]} (a count N means 0..N-1, or a list of values)"
    if not isinstance(spec, dict) or not spec:
        _fail(where, label, f"for: must be a non-empty mapping of variables; {hint}, not {_a(spec)}")
    names, values = [], []
    for name, value in spec.items():
        if not isinstance(name, str) or not name.isidentifier():
            _fail(where, label, f"for: variable {name!r} is not a valid name (letters, digits, _); {hint}")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            value = range(value)
        elif not isinstance(value, list) or not value:
            _fail(where, label, f"for: {name}: {value!r} is not a count >= 1 or a non-empty list; {hint}")
        names.append(name)
        values.append(value)
    return names, values


def _fill(body, env, where, label):
    """Format every string value of an entry's ``body`` with the loop variables. Only the values
    themselves: every key of an entry takes a scalar, and a list or mapping there (refused later, and
    described short) may be a YAML alias standing for gigabytes, not to be walked or copied whole."""
    filled = {key: _fill_string(value, env, where, label) if isinstance(value, str) else value
              for key, value in body.items()}
    for key in TYPED_TEMPLATE_KEYS.intersection(body):
        if isinstance(body[key], str):
            filled[key] = _read_back(filled[key])
    return filled


# Keys that take a number or a boolean: a template there ('count: "{n}"') fills in text, read back as
# YAML would have read the loop value written unquoted.
TYPED_TEMPLATE_KEYS = frozenset({"count", "directed"})


def _read_back(text):
    if len(text) > 20:              # no count or flag: left as text, for the key's own check to refuse
        return text
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (int, bool)) else text


def _fill_string(value, env, where, label):
    problem = _template_problem(value)
    if problem:
        _fail(where, label, f"template {value!r}: {problem}")
    try:
        return value.format(**env)
    except KeyError as exc:
        _fail(where, label, f"template {value!r} uses {{{exc.args[0]}}}, which is not a for: "
                            f"variable (have {', '.join(env)}); fix the name or add it to for:")
    except (IndexError, ValueError, TypeError, AttributeError) as exc:
        _fail(where, label, f"cannot fill template {value!r} ({exc}); templates are Python "
                            f"str.format strings such as 'h{{i}}/gpu{{p[0]}}'")
    except RecursionError:          # '{p}' of a list nested thousands deep (from a dict, not a file)
        _fail(where, label, "the entry is nested too deeply to be a topology entry")


# The widest field a template may ask for ('{i:>1000000000}' would take a gigabyte per entry).
MAX_FIELD_WIDTH = 64


@functools.lru_cache(maxsize=1024)
def _template_problem(value):
    """What a template may not do, or None: read attributes (``{i.__class__}``: names and indexes are
    what ids need) or ask for fields wider than :data:`MAX_FIELD_WIDTH`. Checked once per template."""
    try:
        fields = [(name, spec) for _, name, spec, _ in string.Formatter().parse(value) if name is not None]
    except ValueError:
        return None         # (str.format says what is wrong with it)
    for name, spec in fields:
        if "." in name:
            return f"{{{name}}} reads an attribute; use a for: variable or an index such as {{p[0]}}"
        if "{" in spec:
            return f"the format of {{{name}}} is itself a template; write it out, e.g. {{{name}:02d}}"
        widths = [int(w) for w in re.findall(r"\d+", spec)]
        if widths and max(widths) > MAX_FIELD_WIDTH:
            return f"{{{name}:{spec}}} asks for a field of {max(widths)} characters; at most {MAX_FIELD_WIDTH}"
    return None


# ---------------------------------------------------------------------------------- hierarchy form

_TierEntry = namedtuple("_TierEntry", "name count bandwidth latency kind")


def _hierarchy(tiers, where):
    """Nodes, links and leaves of the hierarchy form, built top-down from the ``spine`` switch.

    Children of tier k are linked to their parent with tier k's bandwidth; ids follow the contract
    (``r{rack}/h{host}/gpu{g}`` with 3 tiers, ``h{host}/gpu{g}`` with 2; ``cpu{g}`` for CPU ranks; where
    the ranks are hosts, ``p{pod}/r{rack}/h{host}`` and ``r{rack}/h{host}``)."""
    if not isinstance(tiers, list) or len(tiers) not in (2, 3):
        example = "[{name: gpu, count: 4, bandwidth: 150 GB/s}, {name: host, count: 16, bandwidth: 100 Gbit/s}]"
        given = len(tiers) if isinstance(tiers, list) else _a(tiers)
        _fail(where, "tiers", f"tiers must list 2 or 3 tiers, innermost first, e.g. {example}, not {given}")
    parsed = [_tier(entry, k, where) for k, entry in enumerate(tiers)]
    leaves = math.prod(t.count for t in parsed)
    if leaves > MAX_REPEATS:
        _fail(where, "tiers", f"the tiers make {leaves} ranks ({' x '.join(str(t.count) for t in parsed)}); at most "
                              f"{MAX_REPEATS} (check the counts)")
    nodes = [("tiers", {"id": "spine", "kind": "switch"})]
    links, parents = [], ["spine"]
    for k in reversed(range(len(parsed))):
        tier, label = parsed[k], f"tiers[{k}]"
        prefix, kind = _TIER_NODES[parsed[0].kind or "gpu"][k]
        children = []
        for parent in parents:
            for i in range(tier.count):
                child = f"{prefix}{i}" if parent == "spine" else f"{parent}/{prefix}{i}"
                nodes.append((label, {"id": child, "kind": kind}))
                links.append((label, Link(child, parent, tier.bandwidth, tier.latency)))
                children.append(child)
        parents = children
    return nodes, links, parents


def _tier(entry, k, where):
    label = f"tiers[{k}]"
    if not isinstance(entry, dict):
        _fail(where, label, f"a tier is a mapping such as {{name: gpu, count: 4, bandwidth: 150 GB/s}}, "
                            f"not {_a(entry)}")
    _check_keys(entry, TIER_KEYS, where, label, "a tier")
    name = _optional_string(entry, "name", where, label)
    count = whole_number(entry.get("count"))
    if count is None or count < 1:
        _fail(where, label, f"count must be a whole number >= 1 (children per parent), "
                            f"not {entry.get('count')!r}")
    if "bandwidth" not in entry:
        _fail(where, label, "missing key 'bandwidth'; add the link bandwidth to the parent, e.g. 100 Gbit/s")
    bandwidth = _bandwidth(entry["bandwidth"], where, label, "bandwidth")
    latency = None if entry.get("latency") is None else _latency(entry["latency"], where, label)
    kind = entry.get("kind")
    if kind is not None:
        if k != 0:
            _fail(where, label, "kind applies only to the first (innermost) tier; remove it here")
        if kind not in KINDS:
            _fail(where, label, f"unknown kind {kind!r}{_did_you_mean(str(kind), KINDS)}; kind is one of "
                                f"{', '.join(KINDS)}")
        if kind not in RANK_KINDS:     # the first tier's nodes are the ranks
            _fail(where, label, f"kind {kind!r}: the first tier's nodes are the ranks, which run on {_RANK_NODE}")
    return _TierEntry(name, count, bandwidth, latency, kind)


# ------------------------------------------------------------------------------------ explicit dict

def explicit(spec):
    """The explicit-form dict of a Spec: plain data that :func:`parse` turns back into an equal Spec.

    Values are written with units when that is exact (``'25 GB/s'``), else as plain numbers (bytes/s,
    seconds). Every link carries its latency, so ``defaults.latency`` is dropped: the dict is canonical
    for the fabric, whichever way the file spelled it."""
    out = {"name": spec.name}
    if spec.description is not None:
        out["description"] = spec.description
    defaults = {}
    if "reduce_bandwidth" in spec.defaults:
        defaults["reduce_bandwidth"] = bandwidth_text(spec.defaults["reduce_bandwidth"])
    if spec.defaults.get("message_cost"):
        defaults["message_cost"] = latency_text(spec.defaults["message_cost"])
    if defaults:
        out["defaults"] = defaults
    out["nodes"] = [_node_dict(*node) for node in spec.nodes]
    out["links"] = [_link_dict(link) for link in spec.links]
    out["ranks"] = list(spec.ranks)
    return out


def _node_dict(node_id, kind, attrs):
    out = {"id": node_id, "kind": kind}
    if "host" in attrs:
        out["host"] = attrs["host"]
    if "reduce_bandwidth" in attrs:
        out["reduce_bandwidth"] = bandwidth_text(attrs["reduce_bandwidth"])
    return out


def _link_dict(link):
    out = {"a": link.a, "b": link.b, "bandwidth": bandwidth_text(link.bandwidth),
           "latency": latency_text(link.latency)}
    if link.count != 1:
        out["count"] = link.count
    if link.directed:
        out["directed"] = True
    return out


def bandwidth_text(value):
    """``25e9`` -> ``'25 GB/s'`` when that parses back exactly, else the number itself."""
    return _exact_text(value, parse_bandwidth, (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6),
                                                ("kB/s", 1e3), ("B/s", 1.0)))


def latency_text(value):
    """``1e-6`` -> ``'1 us'`` when that parses back exactly, else the number itself."""
    return _exact_text(value, parse_latency, (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)))


def _exact_text(value, parse_text, units):
    for unit, scale in units:
        if value >= scale or scale == units[-1][1]:
            text = f"{value / scale:.15g} {unit}"
            if "e" not in text and _canonical(parse_text(text)) == value:
                return text
            break
    return value


# ------------------------------------------------------------------------------------------ helpers

def _fail(where, entry, message):
    raise TopologyError(message, source=where, entry=entry)


# Wrong values are shown cut short, and built short: YAML aliases let a few hundred bytes stand for
# gigabytes of nested lists, and a whole file of another format can arrive as one string.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 6, 6, 6
_SHORT.maxstring, _SHORT.maxother = 80, 80


def _a(value):
    """'a list', 'the string 'x'' ...: how a wrong value is described in messages (at most 120
    characters)."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, str):
        return f"the string {_SHORT.repr(value)}"
    names = {dict: "a mapping", list: "a list", tuple: "a tuple", bool: "a boolean", int: "a number",
             float: "a number"}
    return f"{names.get(type(value), type(value).__name__)} ({_SHORT.repr(value)})"[:120]


def _did_you_mean(word, choices, cutoff=0.5):
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=cutoff)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _check_keys(entry, allowed, where, label, what):
    for key in entry:
        if key not in allowed:
            repeat = " (and for: to repeat it)" if what in ("a node", "a link", "a rank") else ""
            _fail(where, label, f"unknown key {key!r}{_did_you_mean(str(key), allowed, 0.6)}; {what} takes "
                                f"{', '.join(allowed)}{repeat}")


def _string(entry, key, where, label, what):
    if key not in entry:
        _fail(where, label or key, f"missing key {key!r}; {what} needs {key}")
    value = entry[key]
    if not isinstance(value, str) or not value:
        _fail(where, label or key, f"{key} must be a non-empty string, not {_a(value)}{_quote_hint(key, value)}")
    return _text(value, key, where, label)


def _quote_hint(key, value):
    """How to make YAML read a name it took for a number or a boolean as text. The loaded value is not
    what the file said (``no``, ``off`` and ``false`` all load as False; ``010`` as 8), so the hint
    asks for the file's own spelling and shows one."""
    if isinstance(value, bool):
        words = "yes, on or true" if value else "no, off or false"
        return (f": YAML reads an unquoted {words} as a boolean; quote it as the file spells it, "
                f"e.g. {key}: \"{'yes' if value else 'no'}\"")
    if isinstance(value, (int, float)):
        return f"; quote it as the file spells it, e.g. {key}: \"{value}\""
    return ""


def _optional_string(entry, key, where, label=None):
    value = entry.get(key)
    if value is not None and not isinstance(value, str):
        _fail(where, label or key, f"{key} must be a string, not {_a(value)}")
    return value if value is None else _text(value, key, where, label)


def _text(value, key, where, label):
    """``value`` when it is text: YAML's and JSON's escape '\\ud800' makes a string with half of a
    UTF-16 pair, which no file can hold and the topology's fingerprint (sha256 of UTF-8) cannot
    encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        _fail(where, label or key, f"{key} {_SHORT.repr(value)} contains an unpaired surrogate "
                                   f"({value[exc.start]!r}, half of a UTF-16 pair); write the character "
                                   f"itself or its pair, e.g. '\\ud83d\\ude80'")
    return value


def _bandwidth(value, where, label, key):
    try:
        result = _signed(parse_bandwidth, value)
    except (ValueError, OverflowError):
        _fail(where, label, f"cannot read {key} {value!r}: write a number and a unit, one of "
                            f"{BANDWIDTH_UNITS} {BANDWIDTH_PS}, e.g. '25 GB/s' or '100 Gbit/s'"
                            f"{missing_unit_hint(value, f'{value} B/s')}")
    what = ("the rate at which the node adds up data, e.g. '200 GB/s'" if key == "reduce_bandwidth" else
            "the rate of one link in one direction, e.g. '25 GB/s'")
    if not math.isfinite(result) or result <= 0:
        _fail(where, label, f"{key} must be positive and finite, got {value!r}; give {what}")
    if not MIN_BANDWIDTH <= result <= MAX_BANDWIDTH:
        _fail(where, label, f"{key} {value!r} is outside what ddl plans for (1 B/s to 1 EB/s); give {what}")
    if isinstance(value, int) and not isinstance(value, bool) and result < BARE_NUMBER_WARNING:
        # bytes/s by definition, but `bandwidth: 100` means 100 Gbit/s to whoever wrote it (a float is
        # left alone: what Topology.to_dict writes for a rate no unit gives exactly, a scaled one, say)
        entry = (label or key).split(" (")[0]        # once per entry, not per repetition of a for:
        warnings.warn(f"{where}: {entry}: {key} {value!r} has no unit and is read as {value!r} B/s; write "
                      f"the unit, e.g. '{value} Gbit/s' or '{value} GB/s' (or '{value} B/s' if that is meant)",
                      stacklevel=2)
    return result


BARE_NUMBER_WARNING = 1e6    # bytes/s: a whole bare number under 1 MB/s is more likely a rate without its unit


def _latency(value, where, label):
    return _duration(value, where, label, "latency")


def _duration(value, where, label, key):
    try:
        result = _signed(parse_latency, value)
    except (ValueError, OverflowError):
        _fail(where, label, f"cannot read {key} {value!r}: write a number and a unit, one of "
                            f"{LATENCY_UNITS}, e.g. '2 us'{missing_unit_hint(value, f'{value} s')}")
    if not math.isfinite(result) or result < 0:
        _fail(where, label, f"{key} must be zero or positive and finite, got {value!r}, e.g. '2 us'")
    if result > MAX_DURATION:
        _fail(where, label, f"{key} {value!r} is outside what ddl plans for (0 to {MAX_DURATION:g} s); "
                            f"give the time of one hop (or of posting one message), e.g. '2 us'")
    return result


def _signed(parse_text, value):
    """ddl.units reads no sign; read '-5 GB/s' as -5e9 so the message can say "must be positive"."""
    if isinstance(value, str) and value.strip().startswith("-"):
        return -_canonical(parse_text(value.strip()[1:]))
    return _canonical(parse_text(value))


def _canonical(value):
    """Round to 12 significant digits, so that spellings of one value ('1000 ns', '1 us', 1e-6) give
    the same float and hence the same fingerprint (unit scaling leaves last-bit noise otherwise)."""
    return float(f"{value:.12g}")

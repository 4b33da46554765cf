"""What each link of an emulated cluster carried, read from its shapers' byte counters (``tc -s``).

Every direction of an emulated link is one ``tbf`` on the device that transmits it (see
:mod:`ddl.emulate.netns`), and a ``tbf`` counts every byte it sends. Two readings around a collective
therefore give the bytes it put on each direction of each link: whole frames, with their Ethernet, IP
and TCP headers, and with TCP's acknowledgements and any retransmission. ``ddl bench --links`` sets
them beside the data ddl's schedule was planned to put there (:func:`planned`, from
:func:`ddl.simulate.link_totals`): that is how a schedule that takes longer than predicted shows
whether it moved more bytes than planned, or the planned bytes more slowly.
"""
import json
import os
import subprocess
from dataclasses import dataclass

from ..errors import Error
from . import netns


@dataclass(frozen=True)
class ShapedLink:
    """One direction of one emulated link: where its ``tbf`` is, and the topology vertices it joins."""
    name: str                   # "h0 -> rack0"
    netns: str                  # namespace of the transmitting device
    dev: str                    # the transmitting device
    src: str                    # topology vertex the traffic leaves (a host or a switch)
    dst: str                    # topology vertex it enters


def shaped_links(plan):
    """Every shaped direction of cluster ``plan`` (:class:`~ddl.emulate.netns.NetworkPlan`): each host's
    NIC both ways (``eth0`` in the host, its port on the switch), then each switch-to-switch link."""
    links = []
    for h in plan.hosts:
        if h.switch is not None:
            links.append(ShapedLink(f"{h.id} -> {h.switch}", h.netns, "eth0", h.id, h.switch))
            links.append(ShapedLink(f"{h.switch} -> {h.id}", plan.switch_netns, h.port, h.switch, h.id))
    for u in plan.uplinks:
        links.append(ShapedLink(f"{u.a} -> {u.b}", plan.switch_netns, u.end_a, u.a, u.b))
        links.append(ShapedLink(f"{u.b} -> {u.a}", plan.switch_netns, u.end_b, u.b, u.a))
    return tuple(links)


def current_cluster():
    """The plan of the emulated cluster this process runs in (``ddl emulate run`` names it in
    ``DDL_EMULATED_CLUSTER``); :class:`ddl.Error` outside one."""
    name = os.environ.get("DDL_EMULATED_CLUSTER")
    if not name:
        raise Error("not inside an emulated cluster: run under `ddl emulate run FILE -- ...` (or `ddl bench "
                    "FILE --emulate`) to read its links")
    return netns.Cluster.load(netns.state_dir_for(name)).plan


def read(links, run=subprocess.run):
    """``{link name: bytes sent so far}`` for ``links``: one ``tc -s -j qdisc show`` per namespace.
    ``run``: how to run it (tests pass a stand-in)."""
    wanted = {}
    for link in links:
        wanted.setdefault(link.netns, {})[link.dev] = link.name
    sent = {}
    for ns, devs in wanted.items():
        res = run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"], capture_output=True, text=True,
                  timeout=netns.COMMAND_TIMEOUT)
        if res.returncode != 0:
            raise Error(f"cannot read the shapers of namespace {ns} (`tc -n {ns} -s -j qdisc show`: "
                        f"{res.stderr.strip() or 'exit status ' + str(res.returncode)}); is the cluster still up?")
        for qdisc in json.loads(res.stdout or "[]"):
            if qdisc.get("kind") == "tbf" and qdisc.get("dev") in devs:
                sent[devs[qdisc["dev"]]] = int(qdisc["bytes"])
        missing = sorted(name for dev, name in devs.items() if name not in sent)
        if missing:
            raise Error(f"no shaper found for link {missing[0]} in namespace {ns}: the cluster is not the "
                        "one that was built (was it taken down?)")
    return sent


def planned(topo, links, totals):
    """``{link name: bytes}`` of data the topology's links carry (``totals``, as
    :func:`ddl.simulate.link_totals` gives them) on each emulated direction of ``links``.

    A switch-to-switch direction is one topology link. A host's NIC carries what every link from the
    host's own vertices (its ranks, CPUs, NICs: as the emulator assigns them) to its switch carries, or
    back."""
    hosts = {v for v in topo.nodes if topo.kind(v) == "host"}
    owner = netns.ownership(topo, hosts)
    out = {}
    for link in links:
        if link.src in hosts:
            out[link.name] = sum(b for (u, v), b in totals.items() if v == link.dst and owner.get(u) == link.src)
        elif link.dst in hosts:
            out[link.name] = sum(b for (u, v), b in totals.items() if u == link.src and owner.get(v) == link.dst)
        else:
            out[link.name] = totals.get((link.src, link.dst), 0.0)
    return out


class Meter:
    """Bytes that each implementation put on every link, over the calls it made through :meth:`around`."""

    def __init__(self, links, read=read):
        self.links = tuple(links)
        self._read = read
        self.sent = {}          # implementation -> {link name: bytes}
        self.calls = {}         # implementation -> calls measured

    def around(self, name, call):
        """``call()``'s result; the counters are read just before and just after it."""
        before = self._read(self.links)
        result = call()
        after = self._read(self.links)
        sent = self.sent.setdefault(name, dict.fromkeys(before, 0))
        for link, count in after.items():
            sent[link] += count - before[link]
        self.calls[name] = self.calls.get(name, 0) + 1
        return result

    def per_call(self, name):
        """``{link name: bytes}`` per call of ``name`` (averaged), or None if none was measured."""
        calls = self.calls.get(name)
        return {link: b / calls for link, b in self.sent[name].items()} if calls else None

    def clear(self):
        self.sent.clear()
        self.calls.clear()

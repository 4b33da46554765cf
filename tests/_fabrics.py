"""Small fabrics built in code, shared by the tests that probe and correct them (test_calibrate.py
without MPI, test_emulate.py on an emulated cluster)."""
from ddl.topology import Topology

MBIT = 1e6 / 8   # bytes/s


def two_rack_fabric(uplink, name="racks", nic=200 * MBIT, **defaults):
    """Two racks of two hosts with one rank each: ``nic`` bytes/s between a host and its rack switch,
    ``uplink`` bytes/s between each rack switch and the spine (``defaults``: the file's defaults)."""
    nodes = [("spine", "switch"), ("rack0", "switch"), ("rack1", "switch")]
    links = [{"a": f"rack{r}", "b": "spine", "bandwidth": uplink} for r in range(2)]
    for h in range(4):
        nodes += [(f"h{h}", "host"), (f"h{h}/cpu0", "cpu")]
        links += [{"a": f"h{h}/cpu0", "b": f"h{h}", "bandwidth": 5e9},
                  {"a": f"h{h}", "b": f"rack{h // 2}", "bandwidth": nic}]
    return Topology(name, nodes, links, [f"h{h}/cpu0" for h in range(4)], defaults or None)

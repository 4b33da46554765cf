"""Parsing and formatting of bandwidths, latencies and sizes.

Bandwidths are stored in bytes per second, latencies in seconds and sizes in bytes, as floats (ints for
sizes). Units follow the usual convention: a capital ``B`` is a byte, a lower-case ``b`` or ``bit`` is a
bit; ``k M G T`` are decimal, ``Ki Mi Gi Ti`` binary (sizes, up to 1 EiB, also take ``P E Pi Ei``).
"""
import numbers
import operator
import re

_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_LATENCY = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BANDWIDTH_RE = re.compile(rf"^\s*{_NUMBER}\s*(Ki|Mi|Gi|Ti|k|K|M|G|T|)(B|b|bit|bits)(?:/s|ps)\s*$")
_LATENCY_RE = re.compile(rf"^\s*{_NUMBER}\s*(ns|us|µs|μs|ms|s)\s*$")
# Sizes go up to MAX_SIZE, 1 EiB, so they also take P and E (Pi, Ei); bandwidths stop at T (README).
_SIZE_PREFIX = {**_PREFIX, "P": 10**15, "E": 10**18, "Pi": 2**50, "Ei": 2**60}
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E|)(B?)\s*$")

BANDWIDTH_UNITS = "B/s kB/s MB/s GB/s TB/s KiB/s MiB/s GiB/s bit/s kbit/s Mbit/s Gbit/s Tbit/s Gb/s Mb/s"
# Each may end in "ps" instead of "/s" (GBps, Gbps, Mbps), as datasheets write them.
BANDWIDTH_PS = "('/s' may be written 'ps': GBps, Gbps)"
LATENCY_UNITS = "ns us µs ms s"


def missing_unit_hint(text, example):
    """A hint for a number given as text without a unit (``'25'``, or YAML's ``1e9``, which it reads
    as text for want of a dot): a unit is required in text, so that a forgotten one is caught."""
    if not isinstance(text, str):
        return ""
    try:
        float(text)
    except ValueError:
        return ""
    return f" (a number in quotes, or YAML's 1e9 without a dot, is text: add the unit, e.g. {example})"


def parse_bandwidth(text):
    """``'25 GB/s'`` -> 25e9 bytes/s; ``'100 Gbit/s'`` or ``'100 Gb/s'`` -> 12.5e9. Plain numbers are bytes/s."""
    if isinstance(text, bool):
        raise ValueError(f"bandwidth {text!r} is not a number with a unit ({BANDWIDTH_UNITS})")
    if _is_number(text):
        return float(text)
    m = _BANDWIDTH_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse bandwidth {text!r}: write a number and one of {BANDWIDTH_UNITS} "
                         f"{BANDWIDTH_PS}, e.g. "
                         f"'25 GB/s'{missing_unit_hint(text, f'{text} B/s')}")
    value, prefix, unit = m.groups()
    scale = _PREFIX[prefix] * (1.0 if unit == "B" else 0.125)
    return float(value) * scale


def parse_latency(text):
    """``'1 us'`` -> 1e-6 seconds. Plain numbers are seconds."""
    if isinstance(text, bool):
        raise ValueError(f"latency {text!r} is not a number with a unit ({LATENCY_UNITS})")
    if _is_number(text):
        return float(text)
    m = _LATENCY_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse latency {text!r}: write a number and one of {LATENCY_UNITS}, e.g. "
                         f"'2 us'{missing_unit_hint(text, f'{text} s')}")
    return float(m.group(1)) * _LATENCY[m.group(2)]


def whole_number(value):
    """``value`` as an int when it is an integer, Python's or numpy's (np.int64 is no int), else None.
    A bool is none (True would be 1), nor is text or a float, even a whole one: counts, ranks and sizes
    given as numbers must be integers."""
    if isinstance(value, (bool, str)) or not hasattr(value, "__index__"):
        return None
    try:
        return operator.index(value)
    except TypeError:           # numpy's bool has __index__, and refuses it
        return None


def _is_number(value):
    """A plain number: Python's or numpy's (np.int64, np.float32 are not int or float, and their text
    has no unit), never a bool (which is an int)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


MAX_SIZE = 1 << 60   # 1 EiB: sizes beyond it are typing mistakes (1e400 is infinity, 1e300 a file name too long)


def parse_size(text):
    """``'256MiB'`` -> 268435456, ``'64MB'`` -> 64000000, ``'1048576'`` -> 1048576 bytes. An int is
    bytes as given (a negative one is left to the caller), up to MAX_SIZE like the text."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text > MAX_SIZE:     # as its text would be: a planner's float arithmetic overflows on 10**400
            shown = repr(text) if text < 10**40 else f"of {text.bit_length()} bits"   # repr(10**5000) fails
            raise ValueError(f"size {shown} is beyond 1 EiB: write bytes, e.g. 64MiB or 2GiB")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}: write bytes, e.g. 1048576, 64MB, 256MiB or 1EiB")
    number, prefix = m.group(1), _SIZE_PREFIX[m.group(2)]
    # whole numbers exactly (a float would round 2**60 + 1 to 2**60), others through a float
    value = int(number) * int(prefix) if number.isdigit() else float(number) * prefix
    if not value <= MAX_SIZE:
        raise ValueError(f"size {text!r} is beyond 1 EiB: write bytes, e.g. 64MiB or 2GiB")
    if value != int(value) or value < 0:
        raise ValueError(f"size {text!r} is not a whole, non-negative number of bytes")
    return int(value)


def message_size(value):
    """A message size in bytes: a non-negative integer (numpy's too) or text such as ``'64MiB'``;
    ValueError saying why otherwise (a float such as 1.5, a bool, NaN, a negative size)."""
    whole = whole_number(value)
    nbytes = parse_size(value if whole is None else whole)
    if nbytes < 0:
        raise ValueError(f"a message size must be a non-negative number of bytes, got {value!r}")
    return nbytes


def format_bandwidth(bytes_per_second):
    """25e9 -> '25 GB/s' (decimal units, as nccl-tests report)."""
    return _format(bytes_per_second, "B/s")


def format_size(nbytes):
    """Binary units for sizes: 268435456 -> '256 MiB'."""
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                        ("KiB", 2**10)):
        if _shows_one_or_more(nbytes / scale):
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def format_seconds(seconds):
    """1.5e-5 -> '15 us'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if _shows_one_or_more(seconds / scale):
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def counted(n, word, plural=None):
    """(1, 'rank') -> '1 rank'; (8, 'rank') -> '8 ranks'; ``plural`` where an s will not do."""
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"


def _format(value, unit):
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if _shows_one_or_more(value / scale):
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def _shows_one_or_more(x):
    """Whether ``x`` in a unit reads as at least 1 with the 4 digits shown: the unit is chosen for the
    value as shown (999999999.99 B/s is '1 GB/s', not '1000 MB/s')."""
    return abs(float(f"{x:.4g}")) >= 1

"""ddl.units: every documented unit, the bit/byte distinction, and rejection of malformed values."""
import pytest

from ddl.units import (counted, BANDWIDTH_UNITS, format_bandwidth, format_seconds, format_size, parse_bandwidth,
                       parse_latency, parse_size)

BANDWIDTHS = {
    "B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30,
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "Gb/s": 1e9 / 8, "Mb/s": 1e6 / 8,
}


def test_every_documented_bandwidth_unit_is_tested():
    assert set(BANDWIDTH_UNITS.split()) == set(BANDWIDTHS)


@pytest.mark.parametrize("unit,scale", sorted(BANDWIDTHS.items()))
def test_bandwidth_units(unit, scale):
    assert parse_bandwidth(f"3 {unit}") == pytest.approx(3 * scale)
    assert parse_bandwidth(f"2.5{unit}") == pytest.approx(2.5 * scale)


def test_bits_and_bytes_differ_by_eight():
    assert parse_bandwidth("100 Gbit/s") == parse_bandwidth("100 Gb/s") == pytest.approx(12.5e9)
    assert parse_bandwidth("100 GB/s") == pytest.approx(100e9)
    assert parse_bandwidth("100 Gbps") == pytest.approx(12.5e9)
    assert parse_bandwidth("25 GBps") == pytest.approx(25e9) and parse_bandwidth("10 MiBps") == 10 * 2**20
    with pytest.raises(ValueError, match="may be written 'ps': GBps, Gbps"):      # the error says so too
        parse_bandwidth("25 GBs")


def test_plain_numbers_are_bytes_per_second():
    assert parse_bandwidth(25) == 25.0
    assert parse_bandwidth(1.5e9) == 1.5e9


@pytest.mark.parametrize("text", ["25", "25 GB", "25 XB/s", "fast", "", "GB/s"])
def test_bad_bandwidths_name_the_units(text):
    with pytest.raises(ValueError, match="GB/s"):
        parse_bandwidth(text)


def test_bool_is_not_a_bandwidth():
    with pytest.raises(ValueError):
        parse_bandwidth(True)


@pytest.mark.parametrize("text,seconds", [("7 ns", 7e-9), ("7 us", 7e-6), ("7 µs", 7e-6), ("7 ms", 7e-3),
                                          ("7 s", 7.0), ("1.5us", 1.5e-6), ("2e3 ns", 2e-6)])
def test_latency_units(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1", "1 min", "us", "1 GB/s"])
def test_bad_latencies(text):
    with pytest.raises(ValueError, match="us"):
        parse_latency(text)


@pytest.mark.parametrize("text,size", [("1048576", 1048576), ("64MB", 64_000_000), ("256MiB", 2**28),
                                       ("1 KiB", 1024), ("2k", 2000), (4096, 4096),
                                       ("9007199254740993", 2**53 + 1), ("3Ti", 3 * 2**40), ("1.5MiB", 3 << 19)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1.5", "1.5 B", "many"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text", ["1e400", "1e300", str(2 ** 61), "1e19", str(2 ** 60 + 1)])
def test_absurd_sizes_are_refused_not_overflowed(text):
    """1e400 is infinity (OverflowError in int()), 1e300 made a cache file name too long."""
    with pytest.raises(ValueError, match="beyond 1 EiB"):
        parse_size(text)
    assert parse_size(str(2 ** 60)) == 2 ** 60


def test_formatting():
    assert format_bandwidth(25e9) == "25 GB/s"
    assert format_bandwidth(12.5e6) == "12.5 MB/s"
    assert format_bandwidth(999999999.9999999) == "1 GB/s" and format_bandwidth(999.94) == "999.9 B/s"   # not "1000 MB/s"
    assert format_seconds(0.99999999) == "1 s" and format_size(2**20 - 1) == "1 MiB" and format_size(1000) == "1000 B"
    assert format_size(2**28) == "256 MiB"
    assert format_size(100) == "100 B"
    # sizes go up to 1 EiB, and read so (they printed as '1.074e+09 GiB')
    assert [format_size(2**e) for e in (40, 50, 60)] == ["1 TiB", "1 PiB", "1 EiB"]
    assert format_size(10**15) == "909.5 TiB"
    assert format_seconds(1.5e-5) == "15 us"
    assert format_seconds(2e-9) == "2 ns"


@pytest.mark.parametrize("n, args, text", [(1, ("rank",), "1 rank"), (0, ("rank",), "0 ranks"),
                                           (8, ("rank",), "8 ranks"),
                                           (2, ("PCIe switch", "PCIe switches"), "2 PCIe switches"),
                                           (1, ("PCIe switch", "PCIe switches"), "1 PCIe switch")])
def test_counts_are_said_in_the_singular_for_one(n, args, text):
    assert counted(n, *args) == text

"""The README's table of environment settings names every DDL_* variable the package reads."""
import re

from mpi_cases._launch import ROOT

# read by ddl, set by ddl for the processes it launches: not settings for users
SET_BY_DDL = {"DDL_EMULATED_CLUSTER", "DDL_EMULATED_HOSTS", "DDL_INTERRUPT_SAID_OUTSIDE"}

READS = re.compile(r"""(?:env_(?:flag|float|int|word|auto_flag)\(|environ(?:\.get)?[(\[])\s*f?["'](DDL_\w+)["']""")


def _table_variables():
    text = (ROOT / "README.md").read_text()
    table = text.split("### Environment variables", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"`(DDL_\w+)`", "\n".join(line.split("|")[1] for line in table.splitlines()
                                                     if line.startswith("| `"))))


def test_every_environment_setting_is_in_the_readme_table():
    read = {name for path in (ROOT / "ddl").rglob("*.py") for name in READS.findall(path.read_text())}
    read |= {"DDL_STALL_WARNING", "DDL_STALL_TIMEOUT"}          # built from their names: f"DDL_{name.upper()}"
    assert {"DDL_CHECK", "DDL_TOPOLOGY", "DDL_DOORBELL", "DDL_SPIN"} <= read       # the pattern finds them
    table = _table_variables()
    assert read - SET_BY_DDL - table == set(), "read by ddl, missing from README's table"
    assert table - read == set(), "in README's table, read nowhere"

"""Settings read from the environment (``DDL_*``): a value that cannot be read is an error naming the
variable, never taken silently for the default or for its opposite."""
import math
import os

from .errors import Error

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_float(name, default, minimum=None):
    """A number (at least ``minimum``, when given); unset or empty: ``default``."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        number = float(value)
    except ValueError:
        raise Error(f"environment variable {name}={value!r} is not a number") from None
    if math.isnan(number):
        raise Error(f"environment variable {name}={value!r} is not a number")
    if minimum is not None and number < minimum:
        raise Error(f"environment variable {name}={value!r} must be at least {minimum:g}")
    return number


def env_int(name, default, minimum=None):
    """An integer setting (bytes, counts): a whole number (``65536``, ``64e3``), never one rounded."""
    number = env_float(name, default, minimum)
    if not math.isfinite(number) or number != int(number):
        raise Error(f"environment variable {name}={os.environ.get(name)!r} must be a whole number")
    return int(number)


def env_word(name, default, words):
    """One of ``words`` (any case, spaces around it ignored); unset or empty: ``default``."""
    value = (os.environ.get(name) or "").strip().lower() or default
    if value not in words:
        raise Error(f"environment variable {name} must be one of {', '.join(words)}, got {os.environ.get(name)!r}")
    return value


def _on_off(value):
    """True or False for a word of :data:`_TRUE` or :data:`_FALSE` (any case), else None."""
    word = value.lower()
    return True if word in _TRUE else False if word in _FALSE else None


def env_flag(name, default):
    """On or off: ``1 true yes on`` or ``0 false no off`` (any case); unset or empty: ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    flag = _on_off(value)
    if flag is None:
        raise Error(f"environment variable {name}={value!r} is neither on ({', '.join(_TRUE)}) nor off "
                    f"({', '.join(_FALSE)})")
    return flag


def env_auto_flag(name):
    """``auto`` (or unset, or empty): None, for the caller to decide; else on or off as :func:`env_flag`."""
    value = os.environ.get(name, "").strip()
    if value.lower() in ("", "auto"):
        return None
    flag = _on_off(value)
    if flag is None:
        raise Error(f"environment variable {name}={value!r} is neither auto, on ({', '.join(_TRUE)}) nor "
                    f"off ({', '.join(_FALSE)})")
    return flag


def named_by_env(path):
    """``'named by environment variable DDL_TOPOLOGY'`` where ``path`` is the file it names, else ``''``:
    an error about a file the user never typed (``ddl emulate run`` and job scripts set it) says where
    the name came from."""
    env = os.environ.get("DDL_TOPOLOGY")
    if not env or not path:
        return ""
    try:
        same = os.path.abspath(env) == os.path.abspath(os.fspath(path))
    except TypeError:
        return ""
    return "named by environment variable DDL_TOPOLOGY" if same else ""

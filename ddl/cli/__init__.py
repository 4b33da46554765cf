"""The ``ddl`` command line: ``ddl topo``, ``ddl plan``, ``ddl bench``, ``ddl emulate``.

Each sub-command lives in its own module with a ``register(subparsers)`` function that adds its parser
and sets ``func``. User errors (any :class:`ddl.Error`, any OSError: a missing file, a folder where a
file goes) become one line on stderr and
exit status 2; a traceback is shown only for bugs. Output piped into a reader that stops early
(``ddl plan ... | head``) ends quietly, as ``cat`` would, with the status of a broken pipe (141).
"""
import argparse
import importlib
import os
import signal
import sys

from .. import __version__
from ..errors import Error

COMMANDS = ("topo", "plan", "bench", "emulate")


def launcher_rank():
    """This process's rank as the MPI launcher's environment gives it (0 outside a job)."""
    for key in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def same_file_as_any(path, files):
    """Whether ``path`` is one of ``files`` (the same file, by whatever name): a file an option writes
    must not be one the command reads, which it would replace."""
    return os.path.exists(path) and any(os.path.exists(f) and os.path.samefile(path, f) for f in files)


def check_output_file(option, path, example):
    """Fail before the work, not after it: ``path`` (given with ``option``) must name a file that can be
    written, in a folder that exists. One wording for every option that writes a file; ``example`` is
    the file name a message suggests. A symlink is checked where it points, which is what is written
    (:func:`ddl.schedule.write_target`); a device, FIFO or socket is refused, not replaced by a file."""
    from ..schedule import file_kind

    if not path.strip():
        raise Error(f"{option} needs a file name, e.g. {option} {example}")
    if os.path.isdir(path) or path.endswith(os.sep):
        raise Error(f"{option} {path} is a folder: name the file, e.g. {os.path.join(path, example)}")
    target = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
    kind = file_kind(target)
    if kind is not None:
        linked = f" links to {target}, which" if target != os.path.abspath(path) else ""
        raise Error(f"{option} {path}{linked} is {kind}, not a regular file: name a file to write, e.g. "
                    f"{option} {example}")
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise Error(f"{option} {path}: folder {folder} {what}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise Error(f"{option} {path}: {'the file' if os.path.exists(path) else f'folder {folder}'} is not writable")


class _Parser(argparse.ArgumentParser):
    """Under mpiexec every rank reads the same arguments: a mistake in them is said once, by rank 0."""

    def error(self, message):
        if launcher_rank() > 0:
            self.exit(2)
        super().error(message)

    def parse_known_args(self, args=None, namespace=None):
        """Also note in the namespace the innermost (sub)command's parser, which parses first: words
        left over are then refused with that command's usage (``ddl topo show a b``), not ddl's."""
        namespace, extra = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "_parser"):
            namespace._parser = self
        return namespace, extra


INTERRUPT_SAID_OUTSIDE = "DDL_INTERRUPT_SAID_OUTSIDE"
"""Set by a ddl command in the environment of the ddl processes it launches (``ddl bench`` for
``ddl emulate run`` or mpiexec, ``ddl emulate run`` for its job's ranks). A Ctrl-C reaches every one
of them; the command the user typed says ``ddl: interrupted`` once, after they have ended, and they
say nothing of it."""


def say_interrupted(how="interrupted"):
    """``ddl: interrupted`` on stderr, unless a ddl command that launched this one will say it."""
    if not os.environ.get(INTERRUPT_SAID_OUTSIDE):
        print(f"ddl: {how}", file=sys.stderr, flush=True)


def say_if_interrupted(status):
    """Say what an exit status of 128 + N tells when N is Ctrl-C's SIGINT, SIGTERM or SIGHUP: for a
    command whose launched job said nothing of it (:data:`INTERRUPT_SAID_OUTSIDE`)."""
    if status == 128 + signal.SIGINT:
        say_interrupted()
    elif status - 128 in (signal.SIGTERM, signal.SIGHUP):
        say_interrupted(f"interrupted by {signal.Signals(status - 128).name}")


def build_parser():
    parser = _Parser(prog="ddl", description="Topology-aware collective communication.")
    parser.add_argument("--version", action="version", version=f"ddl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            continue
        module.register(sub)
    return parser


def _one_line_warnings():
    """ddl's own warnings as the command line says everything else: ``ddl: warning: ...`` on one line,
    without Python's file and source line; other packages' warnings keep Python's form."""
    import warnings
    shown = warnings.showwarning
    if getattr(shown, "ddl_one_line", False):     # installed by an earlier main() of this process
        return
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(package + os.sep):
            print(f"ddl: warning: {message}", file=file or sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)
    show.ddl_one_line = True
    warnings.showwarning = show


def main(argv=None):
    _one_line_warnings()
    try:
        parser = build_parser()        # (imports every command's module: Ctrl-C may land in it)
    except KeyboardInterrupt:
        say_interrupted()
        return 130
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    args.argv = argv         # as typed: argparse drops a `--` that ends the options (see emulate run)
    if extra:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        status = args.func(args) or 0
        sys.stdout.flush()             # inside the try: a reader that has gone is noticed here
        return status
    except Error as exc:
        print(f"ddl: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print("ddl: error: out of memory (a topology of very many ranks? plan a smaller one, or give the "
              "process more memory)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say_interrupted()
        return 130
    except BrokenPipeError:
        # The reader has gone: point stdout at /dev/null so that the interpreter's final flush does
        # not raise again on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:         # a missing file, a folder where a file goes, a full disk ...
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"ddl: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

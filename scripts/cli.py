"""`batchsim`: one command per question. Each subcommand module in scripts/ has `add_parser` and
`run(args) -> dict`; the dict is printed as the last stdout line (JSON)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import gc
import importlib
import os
import shutil
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import NoReturn


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """A stop signal while the commands' modules load (about a second; SIGTERM and SIGHUP killed
    the command there, exit -15/-1, not a word): one line, not an import's KeyboardInterrupt
    traceback; nothing has been written yet."""
    name = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
    with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone (EIO)
        sys.stderr.write(f"batchsim: interrupted while starting{name}\n")
        sys.stderr.flush()
    drawing = sys.modules.get("batchsim.server.results.drawing_start")
    if drawing is not None:  # its child, if started, goes too: os._exit runs no atexit
        drawing.end_early()
    os._exit(130)  # EXIT_INTERRUPTED, before common (which defines it) is loaded


def _after_start(before: object) -> object:
    """A stop signal's handler once the commands load: Python's KeyboardInterrupt, as Ctrl-C's
    (SIGTERM and SIGHUP too, as every command's run answers them), noted for a run that starts
    later (signals.ctrl_c, not printed where Python swallowed it); an ignored signal (nohup's
    SIGHUP, a background job's SIGINT) stays ignored."""
    if before not in (signal.default_int_handler, signal.SIG_DFL):
        return before
    from batchsim.server.platform import signals

    sys.unraisablehook = signals.unraisable
    return signals.ctrl_c


def _stop_signals_while_starting() -> dict[signal.Signals, object]:
    """The stop signals answered by _interrupted_while_starting, with the handler each had. Not
    in a rank of `--ranks` (mlx.launch's MLX_RANK): rank.joined answers its own."""
    from batchsim.server.platform.signals import STOP_SIGNALS, not_ignored  # the stdlib's only

    stops = not_ignored((signal.SIGINT,) if "MLX_RANK" in os.environ else STOP_SIGNALS)
    return {sig: signal.signal(sig, _interrupted_while_starting) for sig in stops}


# The program itself only: this file run (`python -m batchsim.scripts.cli`, mlx.launch's ranks)
# or the console script `batchsim`, or a copy of it under another name. A test, or a user's
# script (one named cli.py too), importing this keeps its Ctrl-C and its collector.
CONSOLE_SCRIPT_MAX_BYTES = 1024  # pip's and uv's: some 250 bytes that import main and exit by it


def _a_console_script(path: str | None) -> bool:
    """Whether `path` (the __main__ module's file) is a console script of main, whatever its
    name: a few lines that import main and exit with what it returns."""
    try:
        with open(path or "", "rb") as f:
            text = f.read(CONSOLE_SCRIPT_MAX_BYTES + 1)
    except OSError:
        return False
    return (len(text) <= CONSOLE_SCRIPT_MAX_BYTES and b"sys.exit(main())" in text
            and f"from {__name__} import main".encode() in text)


_PROGRAM = (__name__ == "__main__" or Path(sys.argv[0]).name == "batchsim"
            or _a_console_script(getattr(sys.modules.get("__main__"), "__file__", None)))
_BEFORE_START = (_stop_signals_while_starting()
                 if _PROGRAM and threading.current_thread() is threading.main_thread() else {})

def _open_closed_standard_streams() -> None:
    """A standard stream closed by the caller (`batchsim run >&-`, a daemon): Python leaves
    sys.stdout None (an AttributeError traceback while loading) and the run's first file would
    take its descriptor (a library's stray print written into the records). /dev/null takes it."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115


_open_closed_standard_streams()

# What the program's start makes (modules, classes, tables) lives as long as the program: the
# collector's rounds over it while the modules below load found nothing to free (75 collections,
# 9-23 ms of the simulated hour's command under load). Off until the command runs (main). The
# little garbage loading does make (cycles) is frozen with the rest (_collector_back_on).
_LOADING = _PROGRAM
if _LOADING:
    gc.disable()

if _PROGRAM:  # OpenBLAS's kernel question (blas.preload's) asked while the modules below load
    # numpy asks Linux for transparent huge pages for every array of 4 MB or more (checked as it
    # is imported, https://numpy.org/devdocs/reference/global_state.html); with THP's defrag at
    # `madvise` the first touch of each compacts memory: the simulated hour's summary spent
    # 0.18-0.24 s of kernel time so, 0.02 s without. The user's own setting wins.
    os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")
    from batchsim.server.platform import blas as _blas
    from batchsim.server.results import drawing_start as _drawing

    _blas.quiet_openblas_workers()  # before numpy's OpenBLAS loads (common, the drawing child)
    _blas.start_probe()
    if _drawing.wanted_early(sys.argv[1:]):  # matplotlib imported meanwhile, on the other core
        _drawing.start_early()

from batchsim.scripts.common import (  # after the handler; no mlx: blas.preload() comes first
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    err_line,
    show_default,
)

# (heading, [(subcommand, module, one-line help)]): `batchsim --help` lists them so, by question.
GROUPS = [
    ("How many requests fit before the KV cache overruns memory", [
        ("size", "batchsim.scripts.size",
         "per Mac in the catalog: max concurrent sequences and predicted tok/s (no model run)"),
        ("sweep", "batchsim.scripts.sweep",
         "step the batch up to where the KV cache overruns the budget (real, or --executor sim)"),
    ]),
    ("How much batching speeds up decode", [
        ("bench-decode", "batchsim.scripts.bench_decode",
         "decode tok/s per batch size: bare loop vs executor vs mlx-lm"),
        ("compare", "batchsim.scripts.compare",
         "the same workload at batch 1 and batched, side by side"),
        ("roofline", "batchsim.scripts.roofline",
         "GEMV vs GEMM on this device, against measured ceilings"),
    ]),
    ("How a server behaves under realistic traffic", [
        ("run", "batchsim.scripts.run_cmd",
         ("replay traffic through the engine: real, simulated (--executor sim) or over HTTP "
          "(--target URL)")),
        ("serve", "batchsim.scripts.serve_cmd",
         "OpenAI-compatible HTTP server on the continuous-batching engine"),
        ("report", "batchsim.scripts.report_cmd",
         "rebuild a run directory's summary and timeline.png from its records"),
    ]),
    ("How far to trust the simulator", [
        ("calibrate", "batchsim.scripts.calibrate",
         "measure this device and write a profile for the simulator"),
        ("validate", "batchsim.scripts.validate",
         "run workloads real and simulated, report the prediction error"),
        ("fit-macs", "batchsim.scripts.fit_macs",
         "fit the Mac GPU step on published MLX measurements; held-out errors"),
    ]),
    ("Models", [
        ("models", "batchsim.scripts.models_cmd",
         "list the model zoo, build a model, or import a GGUF file"),
    ]),
]
COMMANDS = [command for _, commands in GROUPS for command in commands]
_NAMES = frozenset(name for name, _, _ in COMMANDS)


def help_width() -> int:
    """`batchsim --help`'s width: the terminal's (or COLUMNS), as argparse's own, at most 100."""
    return max(40, min(100, shutil.get_terminal_size().columns - 2))


def commands_help(width: int = 100) -> str:
    """The grouped command list `batchsim --help` prints."""
    lines = ["commands (batchsim COMMAND --help for its flags):"]
    for heading, commands in GROUPS:
        lines.append(f"  {heading}:")
        for name, _, help_text in commands:
            wrapped = textwrap.wrap(help_text, width - 18)
            lines.append(f"    {name:<14}{wrapped[0]}")
            lines += [" " * 18 + more for more in wrapped[1:]]
    return "\n".join(lines)


DESCRIPTION = (  # paragraphs, wrapped to the terminal
    ("batchsim: how much batching speeds up decode on this machine, how many requests fit before "
     "the KV cache overruns memory, and how a server behaves under realistic traffic. Real MLX "
     "compute on models built from real architecture configs (or your own model directory / hub "
     "id), and a calibrated roofline simulator for Macs you do not have."),
    ("Every command prints tables for people, then one JSON document as its last stdout line "
     "(with `--json`, the tables go to stderr and stdout is that line alone)."),
)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends `[default: X]` to a flag's help unless the default is None/False/[] or the help
    already states it (add_field_argument writes the defaults it reads from config dataclasses)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        empty = default is None or default is False or default is argparse.SUPPRESS or default == []
        if "default:" in text or empty:
            return text
        shown = show_default(default).replace("%", "%%")
        return f"{text} [default: {shown}]" if text else f"[default: {shown}]"


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported on one line (usage stays behind --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, " ".join(f"{self.prog}: {message} (see {self.prog} --help)".split())
                  + "\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; `only`: with that command's flags alone (the others' modules are not
    imported: `batchsim run` starts without size's, sweep's, ...)."""
    width = help_width()
    description = "\n\n".join([*(textwrap.fill(p, width) for p in DESCRIPTION),
                                commands_help(width)])
    parser = _Parser(prog="batchsim", description=description,
                     epilog=textwrap.fill(EXIT_CODES_HELP, width),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                help="one of the commands above")
    for name, module, help_text in COMMANDS:
        if only is not None and name != only:
            continue
        mod = importlib.import_module(module)
        p = sub.add_parser(name, description=help_text, epilog=EXIT_CODES_HELP,
                           formatter_class=_DefaultsFormatter)
        mod.add_parser(p)
        if not any("--json" in a.option_strings for a in p._actions):
            p.add_argument("--json", action="store_true",
                           help="stdout carries only the JSON document (tables go to stderr)")
        p.set_defaults(_run=mod.run)
    return parser


def _too_long(exc: OSError) -> str:
    """A model, workload, trace, profile or output name longer than a file name may be (every
    lookup builds a path from it): exit 2 with its start, not exit 1 with 5,000 characters."""
    if exc.filename is None:  # the OS named no file: nothing to measure or quote
        return "a name or path too long for this file system"
    name = str(exc.filename)
    return f"name or path too long for this file system ({len(name)} characters: {name[:60]}...)"


def _os_error_exit(command: str, exc: OSError) -> int:
    """The machine's error (a full disk, a refused connection), or a name too long (input's)."""
    if exc.errno == errno.ENAMETOOLONG:
        err_line(f"batchsim {command}: {_too_long(exc)}")
        return EXIT_USAGE
    err_line(f"batchsim {command}: {exc}")
    return EXIT_FAILED


def _check_out_dirs(args: argparse.Namespace) -> None:
    """--out (models: a model directory, not this) and sweep's, compare's --runs-dir take files,
    checked before the work: size, sweep, compare failed after it."""
    out_dirs = [getattr(args, "out", None) if args.command != "models" else None,
                getattr(args, "runs_dir", None)]
    if any(out_dirs):
        from batchsim.server.results.jsonio import check_writable

        out, runs = out_dirs
        if out:
            check_writable(Path(out))
        if runs:  # made by the first run, once the command's own checks have passed
            check_writable(Path(runs), keep=False)


def _collector_back_on() -> None:
    """The collector on for the command's own work, over none of what loading made (gc.freeze),
    once the program's start turned it off. Loading's few garbage cycles are frozen too: a run
    frees them when its long_lived_heap unfreezes; serve, which never unfreezes, keeps them for
    its life (review r4: 388 objects, about 240 KB traced, a constant that does not grow per
    request). Not collected first: a gc.collect() here costs 20-28 ms, more than loading saves."""
    global _LOADING
    if _LOADING:
        _LOADING = False
        gc.freeze()
        gc.enable()


def _answer_a_swallowed_ctrl_c() -> None:
    """A Ctrl-C Python swallowed in a finalizer is noted for the run that starts next; a command
    that started none lost it silently (exit 0): it is the command's interruption now."""
    signals = sys.modules.get("batchsim.server.platform.signals")  # loaded if it could be
    if signals is not None:
        signals.stop_if_swallowed()


def main(argv: list[str] | None = None) -> int:
    # Choose MLX's BLAS before anything imports mlx (see server/blas.py).
    from batchsim.server.platform import blas

    try:
        blas.preload()
    except RuntimeError as exc:  # BATCHSIM_BLAS names no loadable library: the user's setting
        err_line(f"batchsim: {exc}")
        return EXIT_USAGE
    given = sys.argv[1:] if argv is None else argv
    parser = build_parser(given[0] if given and given[0] in _NAMES else None)
    for sig, before in _BEFORE_START.items():  # the commands' from here
        if signal.getsignal(sig) is _interrupted_while_starting:
            signal.signal(sig, _after_start(before))
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from batchsim.configs import ConfigError
    from batchsim.scripts.common import CommandFailed, emit_json, out
    from batchsim.server.platform import env

    atexit.register(env.release_mlx_streams)  # the main thread's, before MLX's own teardown
    # At exit, no collection over what the command kept: 1.2 s of the simulated hour's command.
    atexit.register(gc.freeze)
    _collector_back_on()
    warning = blas.warning()
    if warning:
        err_line(warning)
    try:
        if getattr(args, "json", False):
            out.file = sys.stderr  # people's tables aside: stdout is the one JSON line
        _check_out_dirs(args)
        summary = args._run(args)
        _answer_a_swallowed_ctrl_c()
    except ConfigError as exc:
        err_line(f"batchsim {args.command}: {exc}")
        return EXIT_USAGE
    except CommandFailed as exc:
        err_line(f"batchsim {args.command}: {exc}")  # first: a stdout that fails ends it
        emit_json(exc.summary)
        return exc.exit_code
    except OSError as exc:
        return _os_error_exit(args.command, exc)
    except KeyboardInterrupt:
        err_line(f"batchsim {args.command}: interrupted")
        return EXIT_INTERRUPTED
    finally:
        out.file = None  # back to whatever sys.stdout is (main runs in-process in tests)
    if summary is not None:
        emit_json(summary)
    code = 0
    if args.command == "run" and isinstance(summary, dict) and summary.get("interrupted"):
        from batchsim.server.distributed.rank import is_rank_process

        if not is_rank_process():  # a rank's 130 would read as a failure to its launcher
            code = EXIT_INTERRUPTED  # the records so far are kept; the code says they are partial
    if _quick_exit(args, argv, summary):
        _exit_without_teardown(code)
    return code


def _quick_exit(args: argparse.Namespace, argv: list[str] | None, summary: object) -> bool:
    """The batchsim program's simulated `run`: no device, no ranks to close."""
    return (_PROGRAM and argv is None and args.command == "run" and isinstance(summary, dict)
            and summary.get("executor") == "sim")


def _exit_without_teardown(code: int) -> None:
    """End the program without freeing what it holds object by object (a simulated hour's records
    hold a million token times: 0.03-0.04 s of freeing for nothing). What exit does that matters is
    done first: atexit's callbacks (logging's flush, MLX's streams), stdout and stderr flushed. A
    thread still running is left to the interpreter's exit to wait for."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # what exit would run, run now
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

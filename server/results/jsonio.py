"""JSON for results: JSONL writers and run directories (the text itself: json_text.py)."""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError
from batchsim.server.results.json_text import dumps, jsonable

# A label is one path component: a model given as a path (`--model /m/x`) nested run
# directories under /m; control characters and over-long names fail in mkdir.
_NOT_IN_A_NAME = re.compile(r"[\x00-\x1f/\\]")
MAX_LABEL_BYTES = 160  # a file name holds 255 bytes; room for the timestamp and `-N`
MAX_SAME_NAME = 10_000  # run directories of one label started in one second

# A workload whose last arrival is past MAX_ARRIVAL_S is refused (workloads/
# requests.py); report reads a record time past MAX_CLOCK_S as damage. The margin between them is
# room for the service after the last arrival: a run whose last request arrives at the limit
# finishes a second later, and report kept only the records before it (2 completed -> 1).
MAX_ARRIVAL_S = 1e9
MAX_CLOCK_S = 2 * MAX_ARRIVAL_S


def yamlable(obj: Any) -> Any:
    """Like jsonable but keeps mapping keys as they are (YAML has integer keys)."""
    if isinstance(obj, dict):
        return {k: yamlable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [yamlable(v) for v in obj]
    return jsonable(obj)


def append_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    return _jsonl(path, rows, "a")


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    return _jsonl(path, rows, "w")


def _jsonl(path: Path, rows: Iterable[dict], mode: str) -> Path:
    """One JSON line per row, the file opened with `mode` (its directory made first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open(mode) as f:
        for row in rows:
            f.write(dumps(row) + "\n")
    return path


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def new_run_dir(out_dir: Path, label: str) -> Path:
    """A fresh `TIMESTAMP-label` directory under out_dir (`-2`, `-3`, ... if it exists). Made
    before a run starts, so an output directory that cannot be written fails before any compute."""
    label = _NOT_IN_A_NAME.sub("_", label).encode()[:MAX_LABEL_BYTES].decode(errors="ignore")
    for n in range(1, MAX_SAME_NAME + 1):  # made, not looked for: two runs in one second
        name = f"{timestamp()}-{label}"  # the second may change between tries: the last one's
        run_dir = out_dir / (name + (f"-{n}" if n > 1 else ""))
        try:
            run_dir.mkdir(parents=True)
            break
        except FileExistsError as exc:
            if not out_dir.is_dir():  # out_dir itself a file or a dangling link: no name helps
                raise _unwritable(out_dir, exc) from None
        except OSError as exc:
            raise _unwritable(out_dir, exc) from None
    else:
        raise ConfigError(f"output directory {out_dir}: {MAX_SAME_NAME:,} run directories "
                          f"named {name} exist already")
    try:
        (run_dir / ".writable").touch()
        (run_dir / ".writable").unlink()
    except OSError as exc:
        raise _unwritable(out_dir, exc) from None
    return run_dir


def _unwritable(out_dir: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"output directory {out_dir}: cannot write a run directory there "
                       f"({exc.strerror or exc})")


def check_writable(out_dir: Path, keep: bool = True) -> None:
    """out_dir exists (made if need be) and takes new files; else a one-line ConfigError. With
    keep=False the directories it had to make are removed again (a directory the command makes
    only once its work begins: nothing is left behind if the command is refused before that)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"output directory {out_dir}: not a directory")
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists() and not d.is_symlink()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        reason = exc.strerror or exc
        raise ConfigError(f"output directory {out_dir}: not writable ({reason})") from None
    finally:
        for directory in made if not keep else ():  # innermost first, each empty
            with contextlib.suppress(OSError):
                directory.rmdir()

"""The files of a model directory batchsim writes: safetensors shards, the marker that says what
built it, and atomic staging (a half-written directory never appears under its name)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

MARKER = "batchsim.json"  # what built the directory: random-weight build or real-weight import
SHARD_BYTES = 2 << 30


def save_weights(out_dir: Path, weights: dict) -> None:
    import mlx.core as mx

    shards: list[dict] = [{}]
    size = 0
    for name, arr in weights.items():
        if size + arr.nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(out_dir / "model.safetensors"), shards[0],
                            metadata={"format": "mlx"})
        return
    index = {"metadata": {"total_size": sum(a.nbytes for a in weights.values())}, "weight_map": {}}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out_dir / fname), shard, metadata={"format": "mlx"})
        index["weight_map"].update({k: fname for k in shard})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


@contextlib.contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary directory beside `out_dir` that replaces it when the block succeeds (a half-built
    model never appears at `out_dir`) and is removed when it fails."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_builds(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-{os.getpid()}-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except RuntimeError as exc:  # MLX's save on a full disk: "[write] Unable to write N bytes..."
        if "[write]" not in str(exc):
            raise
        free = shutil.disk_usage(out_dir.parent).free
        raise OSError(f"cannot write {out_dir}: {str(exc).removeprefix('[write] ').rstrip('.')} "
                      f"({free / 2**20:.0f} MiB free on its disk; full, or a file size limit)"
                      ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_BUILD_TMP = re.compile(r"^\..+\.build-(\d+)-\w+$")  # .NAME.build-PID-RANDOM (mkdtemp's)


def sweep_dead_builds(root: Path) -> list[Path]:
    """Remove the temporary directories of builds whose process is gone (killed, or the machine
    went down: hundreds of MB each); a build in progress elsewhere keeps its own. Returns them."""
    removed = []
    for path in root.glob(".*.build-*") if root.is_dir() else ():
        match = _BUILD_TMP.match(path.name)
        if match and path.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: is there such a process (no signal is sent)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True

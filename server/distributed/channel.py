"""Rank 0 broadcasts each step's plan to every rank through the collective itself: a length, then
the pickled bytes as a uint8 array, both summed with zeros from the other ranks. A rank that
dies makes the collective fail on the others ('[ring] connection to a peer was lost')."""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from batchsim.server.executors.base import ExecutorLost

STOP = None  # the message that ends a follower's loop
# What MLX's ring backend raises when a peer's connection fails (mlx/distributed/ring/ring.cpp,
# 0.32: "[ring] connection to a peer was lost", "Send failed with errno=", "Recv failed with
# errno="); any other RuntimeError from a collective (a Metal or MLX error) is not a lost rank.
_TRANSPORT_ERRORS = ("[ring]", "Send failed", "Recv failed", "socket", "closed", "reset")
_SAMPLE_BYTES = 1 << 20  # per sample when fingerprinting large weight files
_SAMPLES = 16
_FULL_HASH_BYTES = 256 << 20  # files up to this size are hashed whole


class RankLost(ExecutorLost):
    """A collective failed: another rank died or closed its connection."""


class ModelMismatch(ValueError):
    """The ranks hold different model files (every rank finds this out at once)."""


class PlanChannel:
    def __init__(self, group: Any):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.broadcast_s = 0.0  # time spent broadcasting (rank 0) or receiving plans (others)
        self.num_messages = 0
        self.doorbell: Any = None  # once open, wakes followers before each message (doorbell.py)

    def send(self, obj: Any) -> None:
        """Rank 0: every other rank's recv() returns `obj`."""
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        t0 = time.perf_counter()
        if self.doorbell is not None:
            self.doorbell.ring()
        self._sum(mx.array([payload.size], dtype=mx.int32))
        self._sum(mx.array(payload))
        self.broadcast_s += time.perf_counter() - t0
        self.num_messages += 1

    def recv(self, on_wake: Callable[[], None] | None = None) -> Any:
        """The other ranks: the next object rank 0 sent (blocks until it sends one); `on_wake`
        runs once the doorbell rang, before the collectives."""
        if self.doorbell is not None:
            self.doorbell.wait()
        if on_wake is not None:
            on_wake()
        n = int(self._sum(mx.zeros((1,), dtype=mx.int32)).item())
        t0 = time.perf_counter()
        data = self._sum(mx.zeros((n,), dtype=mx.uint8))
        self.broadcast_s += time.perf_counter() - t0
        self.num_messages += 1
        return pickle.loads(np.array(data).tobytes())  # only ranks this run launched send here

    def gather_bytes(self, blob: bytes) -> list[bytes]:
        """Every rank's `blob` (all the same length), in rank order, on every rank."""
        row = mx.array(np.frombuffer(blob, dtype=np.uint8))
        try:
            out = mx.distributed.all_gather(row, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:
            raise _lost(exc, "comparing model files") from None
        flat = np.array(out).tobytes()
        return [flat[i * len(blob): (i + 1) * len(blob)] for i in range(self.size)]

    def _sum(self, x: mx.array) -> mx.array:
        try:
            out = mx.distributed.all_sum(x, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:
            raise _lost(exc, "exchanging plans") from None
        return out


def _lost(exc: RuntimeError, doing: str) -> RuntimeError:
    """A collective's error: RankLost (one line) where the transport failed, else `exc` itself,
    which keeps its traceback (`raise ... from None` leaves an exception's own __traceback__)."""
    if any(word in str(exc) for word in _TRANSPORT_ERRORS):
        return RankLost(f"lost a peer rank while {doing} ({_plain(exc)})")
    return exc


def _plain(exc: BaseException) -> str:
    """MLX's message without its '[ring]' tag (a console would read it as markup)."""
    return str(exc).replace("[ring] ", "ring backend: ")


def model_fingerprint(model_dir: Path) -> bytes:
    """sha256 over config.json and the weight files: whole files up to 256 MiB, else size plus
    16 evenly spaced 1 MiB samples (hashing 400 GB at start would take minutes)."""
    h = hashlib.sha256()
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors")
                   and not p.name.startswith("tokenizer"))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size};".encode())
        with path.open("rb") as f:
            if size <= _FULL_HASH_BYTES:
                h.update(f.read())
                continue
            for i in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


def check_same_model(fingerprints: list[bytes], model_dir: Path) -> None:
    """Refuse to serve when any rank's model files differ from rank 0's."""
    differ = [r for r, fp in enumerate(fingerprints) if fp != fingerprints[0]]
    if differ:
        raise ModelMismatch(
            f"rank(s) {', '.join(map(str, differ))} hold different model files than rank 0 "
            f"(sha256 {fingerprints[differ[0]].hex()[:12]} vs {fingerprints[0].hex()[:12]} of "
            f"{model_dir}); give every rank the same model")

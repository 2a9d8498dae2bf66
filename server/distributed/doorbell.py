"""A follower waiting inside a collective spins a core (the ring backend polls its sockets), which
an idle server would do for hours. So rank 0 rings a plain TCP doorbell, one byte per follower,
before each plan message; a follower sleeps in recv() on it and joins the collective only then.
The doorbell also tells a follower at once that rank 0 is gone (its socket closes)."""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

from batchsim.server.distributed.channel import RankLost

ACCEPT_TIMEOUT_S = 60.0  # the followers connect right after rank 0 sends the port


class Doorbell:
    def __init__(self, rank: int, sockets: list[socket.socket]):
        self.rank = rank
        self.sockets = sockets  # rank 0: one per follower; a follower: the one to rank 0

    @classmethod
    def open(cls, channel: Any) -> Doorbell:
        """Rank 0 listens on its ring address and sends the port over `channel`; the others
        connect and say their rank."""
        host = leader_host()
        if channel.rank != 0:
            sock = socket.create_connection((host, channel.recv()), timeout=ACCEPT_TIMEOUT_S)
            sock.settimeout(None)  # idle for as long as the server is: no deadline here
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(struct.pack("!i", channel.rank))
            return cls(channel.rank, [sock])
        with socket.create_server((host, 0)) as server:
            server.settimeout(ACCEPT_TIMEOUT_S)
            channel.send(server.getsockname()[1])
            by_rank = {}
            for _ in range(channel.size - 1):
                sock, _addr = server.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                by_rank[struct.unpack("!i", _read_exactly(sock, 4))[0]] = sock
        return cls(0, [by_rank[r] for r in sorted(by_rank)])

    def ring(self) -> None:
        """Rank 0: wake every follower for the next message."""
        for sock in self.sockets:
            try:
                sock.sendall(b"\1")
            except OSError as exc:
                raise RankLost(f"lost a peer rank while waking it ({exc})") from None

    def wait(self) -> None:
        """A follower: sleep until rank 0 rings (no CPU while the server is idle)."""
        try:
            data = self.sockets[0].recv(1)
        except OSError as exc:
            data, why = b"", f" ({exc})"
        else:
            why = ""
        if not data:
            raise RankLost(f"rank 0 closed its connection: it stopped or died{why}")

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def leader_host() -> str:
    """Rank 0's IP address from mlx.launch's ring hostfile (loopback without one)."""
    path = os.environ.get("MLX_HOSTFILE", "")
    try:
        with open(path) as f:
            return json.load(f)[0][0].rsplit(":", 1)[0]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return "127.0.0.1"


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise RankLost("a follower closed its doorbell before saying its rank")
        data += chunk
    return data

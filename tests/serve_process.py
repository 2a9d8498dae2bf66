"""`batchsim serve` in a subprocess on loopback (tiny model) for the tests that drive it: the
process, its URL and metrics, and the requests and streams they send (moved from
test_http_server.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from batchsim.scripts.serve_cmd import LISTENING
from batchsim.server.http.prometheus import parse as parse_metrics
from batchsim.workloads.client.sse import SSEParser

from tests import dispositions

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-batchsim-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
# 2 MiB of memory leaves the tiny model (~0.4 MB of weights) ~1.7 MB of KV (~3,300 tokens at 512
# bytes each): a 3,400-token prompt fits the 4,096-token context but not the KV budget.
MEMORY_GB = "0.002"


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


class ServerProcess:
    def __init__(self, home: Path, *args: str, ignored: tuple[signal.Signals, ...] = ()):
        cmd = [sys.executable, "-m", "batchsim.scripts.cli", "serve", "--model",
               "tiny", "--port", "0",
               *args]
        env = {**os.environ, "BATCHSIM_HOME": str(home)}
        self.proc = subprocess.Popen(dispositions.command(cmd, *ignored), cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:  # keep draining stderr so the pipe never fills
            for line in self.proc.stderr:
                self.stderr.append(line)
                if LISTENING in line and not found.is_set():
                    self.url = line.split(LISTENING, 1)[1].strip()
                    found.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not found.wait(90):
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr))
        self.client = httpx.Client(base_url=self.url, timeout=60)
        assert self.client.get("/health").json() == {"status": "ok"}

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.client.get("/metrics").text)

    def wait_idle(self, timeout_s: float = 20) -> dict[str, float]:
        """Metrics once nothing runs or waits and both KV counts are back to the cached prompt
        blocks."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["batchsim_requests_running"] == m["batchsim_requests_waiting"] == 0
                    and m["batchsim_kv_bytes"] == m["batchsim_kv_bytes_measured"]
                    == m["batchsim_prefix_cache_bytes"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def connect(self) -> socket.socket:
        """A raw TCP connection to the server (a hang fails on the timeout, not on a bound)."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=30)

    def stop(self, timeout_s: float = 30) -> int:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._reader.join(timeout_s)  # stderr read to its end



def post(srv: ServerProcess, path: str, body: dict, **kw) -> httpx.Response:
    return srv.client.post(path, json=body, headers=AUTH, **kw)


def stream_events(srv: ServerProcess, path: str, body: dict) -> list:
    parser, events = SSEParser(), []
    with srv.client.stream("POST", path, json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for data in r.iter_bytes():
            events += parser.feed(data)
    return events + parser.close()


def stream_text(events: list, chat: bool) -> str:
    key = (lambda c: c["delta"].get("content", "")) if chat else (lambda c: c["text"])
    return "".join(key(e.json()["choices"][0]) for e in events
                   if not e.is_done and e.json()["choices"])

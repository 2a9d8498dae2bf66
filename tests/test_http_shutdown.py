"""`batchsim serve`'s queue limit and its shutdown (SIGTERM, SIGHUP, an ignored SIGHUP), each on
a server of its own (moved from test_http_server.py)."""

from __future__ import annotations

import signal
import threading
import time

from tests.serve_process import ServerProcess, stream_events


# -- queue limit and shutdown on a second, small server ------------------------------------------
def test_queue_full_then_sigterm_drains(batchsim_home):
    small = ServerProcess(batchsim_home, "--max-num-seqs", "1", "--max-queue", "1",
                          "--drain-timeout-s", "2")
    try:
        _check_queue_and_drain(small)
    finally:
        if small.proc.poll() is None:
            small.proc.kill()


def test_sighup_drains_as_sigterm_does(batchsim_home):
    """The terminal closed: the server drains and prints its totals, exit 0 (not killed)."""
    server = ServerProcess(batchsim_home, "--drain-timeout-s", "2")
    try:
        server.proc.send_signal(signal.SIGHUP)
        assert server.proc.wait(30) == 0, "".join(server.stderr)
        assert '"aborted_at_shutdown":0' in server.proc.stdout.read()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_sighup_nohup_said_to_ignore_stays_ignored(batchsim_home):
    """Under nohup the server stopped on hangup: serve() added its loop handler over the
    inherited SIG_IGN. The SIGHUP now leaves it serving; SIGTERM still drains it."""
    server = ServerProcess(batchsim_home, "--drain-timeout-s", "2", ignored=(signal.SIGHUP,))
    try:
        server.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)  # a handled one would have begun the drain by now
        assert server.client.get("/health").json() == {"status": "ok"}
        assert server.stop() == 0, "".join(server.stderr)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def _check_queue_and_drain(small: ServerProcess) -> None:
    long_body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    results: dict[str, list] = {}

    def consume(name: str, body: dict) -> None:
        results[name] = stream_events(small, "/v1/completions", body)

    running = threading.Thread(target=consume, args=("running", long_body))
    running.start()
    _wait_for(small, "batchsim_requests_running", 1)
    waiting = threading.Thread(target=consume, args=("waiting", {**long_body, "max_tokens": 5}))
    waiting.start()
    _wait_for(small, "batchsim_requests_waiting", 1)
    r = small.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    assert small.client.get("/health").status_code == 200

    small.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 1.5  # draining: new requests are refused
    while small.client.get("/health").status_code != 503:
        assert time.monotonic() < deadline
    assert small.client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    running.join(30)
    waiting.join(30)
    assert small.proc.wait(30) == 0, "".join(small.stderr)
    finals = {k: [e.json() for e in v if not e.is_done][-1]["choices"][0]["finish_reason"]
              for k, v in results.items()}
    assert finals == {"running": "abort", "waiting": "abort"}  # past the 2 s drain timeout
    assert all(v[-1].is_done for v in results.values())
    assert '"aborted_at_shutdown":2' in small.proc.stdout.read()


def _wait_for(s: ServerProcess, name: str, value: float, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while s.metrics()[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)

"""`run --target` against servers that fail every request or never answer, and malformed targets:
one line that says why, or an interruption (moved from test_inputs.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cli_calls import _batchsim, _main, _one_line, last_json


@contextlib.contextmanager
def _fake_target(status: int, body: bytes = b"", hang: threading.Event | None = None):
    """The base URL of a server answering every request `status` and `body`; with `hang`, its
    POSTs wait for that event first (a server that never answers)."""
    import http.server

    class Answer(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            if hang is not None and self.command == "POST":
                hang.wait(60)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        if hang is not None:
            hang.set()
        server.shutdown()


@pytest.mark.parametrize("status, body, says", [
    (401, b"", "(HTTP 2 x 401); the server wants an API key: set OPENAI_API_KEY"),
    (200, b"<html>oops</html>", "(HTTP 2 x 200); the first: stream ended without [DONE]"),  # said
    # only "failed (HTTP statuses: {'200': 2})"
    (404, b"", "answer under /v1: try --target http://127.0.0.1:"),  # a target without /v1
])
def test_run_target_that_fails_every_request_says_why(batchsim_home, tmp_path, status, body,
                                                      says):
    with _fake_target(status, body) as url:
        url = url.removesuffix("/v1") if status == 404 else url
        proc = _batchsim("run", "--model", "tiny", "--target", url, "--num-prompts", "2",
                         "--out", str(tmp_path), "--no-progress", home=batchsim_home,
                         env={"OPENAI_API_KEY": ""})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_ctrl_c_on_a_run_against_a_server_that_never_answers_is_an_interruption(batchsim_home,
                                                                              tmp_path, sig):
    """Exit 130 with the summary marked interrupted (was 1: 'all 2 requests ... failed'), and
    naming the signal as an in-process run's does (interrupt_reason was missing)."""
    env = {**os.environ, "BATCHSIM_HOME": str(batchsim_home), "HF_HUB_OFFLINE": "1"}
    with _fake_target(200, hang=threading.Event()) as url:
        proc = subprocess.Popen([sys.executable, "-m", "batchsim.scripts.cli", "run", "--model",
                                 "tiny", "--target", url, "--num-prompts", "2", "--request-rate",
                                 "inf", "--out", str(tmp_path), "--no-progress"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for line in proc.stderr:  # the requests go out once the run names its workload
            if "requests of workload" in line:
                break
        time.sleep(1.0)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = last_json(out)
    assert last["interrupted"] is True and last["interrupt_reason"] == sig.name
    saved = json.loads(Path(last["run_dir"], "summary.json").read_text())
    assert saved["interrupt_reason"] == sig.name


@pytest.mark.parametrize("target, says", [
    ("http://[::1", "not a URL (Invalid IPv6 URL)"),
    ("http://127.0.0.1:99999/v1", "not a URL (Port out of range"),
    ("ftp://x/v1", "expected an http:// or https:// URL with a host"),
    ("127.0.0.1:8000/v1", "expected an http:// or https:// URL with a host"),
])
def test_a_malformed_target_is_bad_input_not_a_run_of_failures(capsys, tmp_path, target, says):
    """Each ran the whole workload against nothing: 'all 2 requests failed (no response)', rc 1."""
    rc, _, err = _main(["run", "--target", target, "--num-prompts", "2", "--out", str(tmp_path)],
                       capsys)
    assert rc == 2 and f"target {target!r}: {says}" in _one_line(err), err


@pytest.mark.parametrize("target, hint", [
    ("http://h:8000/chat/completions", "http://h:8000/v1/chat/completions"),  # was .../v1 at end
    ("http://h:8000/completions/", "http://h:8000/v1/completions"),
    ("http://h:8000/", "http://h:8000/v1"),
])
def test_the_v1_hint_goes_after_the_targets_base(tmp_path, target, hint):
    from batchsim.scripts.run_cmd import _all_failed
    from batchsim.workloads.client.stream import endpoint

    (tmp_path / "requests.jsonl").write_text(json.dumps({"error": "HTTP 404"}) + "\n")
    summary = {"http_statuses": {"404": 2}, "failed": 2, "endpoint": endpoint(target).url,
               "target": target, "run_dir": str(tmp_path)}
    assert f"try --target {hint};" in _all_failed(summary)

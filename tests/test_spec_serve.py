"""`serve` speculating (n-gram drafts) on loopback: /metrics counts the tokens the responses
emitted, not the ones a verify step sampled for a row it then cut at a stop."""

from __future__ import annotations

import random

import pytest

from tests.serve_process import ServerProcess, post


@pytest.fixture(scope="module")
def spec_srv(batchsim_home):
    s = ServerProcess(batchsim_home, "--spec-method", "ngram", "--spec-tokens", "4",
                      "--spec-policy", "fixed")
    yield s
    assert s.stop() == 0, "".join(s.stderr)


def test_generation_tokens_are_the_completion_tokens(spec_srv):
    # tiny's greedy reply to this prompt starts "bbbbbbbbb" (token 67 nine times), which the
    # drafter proposes and the verifier keeps: a stop string of j b's ends inside a step's drafts.
    rng = random.Random(31)
    prompt = [rng.randrange(512) for _ in range(rng.randint(5, 30))] * 3
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True}
    before = spec_srv.wait_idle()
    usage = [post(spec_srv, "/v1/completions", {**body, "stop": "b" * j}).json()
             ["usage"]["completion_tokens"] for j in range(2, 10)]
    after = spec_srv.wait_idle()
    assert after["batchsim_spec_decode_num_accepted_tokens_total"] > 0
    assert usage == list(range(2, 10))  # the stop string's tokens are kept, as in vLLM
    delta = after["batchsim_generation_tokens_total"] - before["batchsim_generation_tokens_total"]
    assert delta == sum(usage)

"""The sampling fields of an OpenAI request, checked in vLLM's ranges into SamplingParams. Each is
applied per row by the executor's sampler (server/executors/sampler.py) or refused with a 400
naming it; docs/serve-api.md's "Request fields" table lists them with their defaults."""

from __future__ import annotations

import math
from typing import Any

from batchsim.scheduler.request import SamplingParams
from batchsim.server.http.fields import APIError, check, get, is_int, is_number, number_in

DEFAULT_TEMPERATURE = 0.0  # greedy, as mlx_lm.server (OpenAI and vLLM: 1)
# Below this a temperature is greedy, as vLLM's _SAMPLING_EPS: logits / 1e-39 overflow to inf and
# the draw turns uniform instead of sharp.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = 2**32  # seeds are reduced modulo this: the executor folds them into a 64-bit key
PENALTY_LIMIT = 2.0  # frequency and presence penalties lie in [-2, 2] (OpenAI, vLLM)
LOGIT_BIAS_LIMIT = 100.0  # a bias lies in [-100, 100] (OpenAI)
MAX_LOGIT_BIAS = 1024  # entries: each one is work in every step the request samples
MAX_STOP_TOKEN_IDS = 64


def parse_sampling(body: dict[str, Any], vocab_size: int) -> SamplingParams:
    """Every sampling field of `body`; max_tokens is set when the server admits the request."""
    temperature = number_in(body, "temperature", DEFAULT_TEMPERATURE, 0, math.inf)
    top_k = get(body, "top_k", 0)
    check(body, "top_k", is_int(top_k) and top_k >= -1, "-1 or 0 (off) or an integer >= 1")
    seed = body.get("seed")
    check(body, "seed", seed is None or (is_int(seed) and -(2**63) <= seed < 2**63),
          "a 64-bit integer")
    ignore_eos = get(body, "ignore_eos", False)
    check(body, "ignore_eos", isinstance(ignore_eos, bool), "a boolean")
    return SamplingParams(
        max_tokens=1,
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        seed=None if seed is None else seed % SEED_RANGE,
        ignore_eos=ignore_eos,
        stop_token_ids=_stop_token_ids(body, vocab_size),
        top_p=number_in(body, "top_p", 1.0, 0, 1, low_open=True),
        top_k=max(top_k, 0),
        min_p=number_in(body, "min_p", 0.0, 0, 1),
        repetition_penalty=number_in(body, "repetition_penalty", 1.0, 0, math.inf, low_open=True),
        frequency_penalty=number_in(body, "frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        presence_penalty=number_in(body, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        logit_bias=_logit_bias(body, vocab_size),
    )


def _logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias}: ids in the vocabulary, biases in [-100, 100]."""
    bias = get(body, "logit_bias", {})
    rule = (f"an object of at most {MAX_LOGIT_BIAS} token ids in [0, {vocab_size}) (as strings) "
            f"to numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
    check(body, "logit_bias", isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, rule)
    pairs = []
    for key, value in bias.items():
        # "01" beside "1" added both biases to token 1: one spelling per id
        ok = (key.isascii() and key.isdigit() and len(key) <= 12 and str(int(key)) == key
              and int(key) < vocab_size
              and is_number(value) and abs(value) <= LOGIT_BIAS_LIMIT)
        if not ok:
            raise APIError(400, f"logit_bias: must be {rule}, got {key[:20]!r}: "
                           f"{str(value)[:20]}", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _stop_token_ids(body: dict[str, Any], vocab_size: int) -> frozenset[int]:
    ids = get(body, "stop_token_ids", [])
    check(body, "stop_token_ids", isinstance(ids, list) and len(ids) <= MAX_STOP_TOKEN_IDS
          and all(is_int(t) and 0 <= t < vocab_size for t in ids),
          f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab_size})")
    return frozenset(ids)

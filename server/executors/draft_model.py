"""The `draft` drafter: a second, smaller model sharing the tokenizer proposes each row's next k
tokens (greedily, or drawn at the row's temperature: q of the rejection rule, acceptance.py), on
its own mlx-lm caches (one per request, kept between steps). Before drafting,
a request's cache is trimmed back to what the target model kept (drafts it rejected are cut) and
fed the tokens it has not seen. Rows draft one after another: simple, not fast at large batch."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors import sampler
from batchsim.server.executors.acceptance import KEY_DRAFT, position_key
from batchsim.server.executors.speculative import Draft
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache


class DraftModelDrafter:
    def __init__(self, model):
        self.model = model
        # request id -> (the draft model's caches, the tokens they hold)
        self._held: dict[int, tuple[list, list[int]]] = {}

    def propose(self, request_id: int, token_ids: list[int], k: int,
                sampling: SamplingParams) -> Draft:
        if k <= 0:
            return Draft([])
        cache, held = self._held.get(request_id) or (make_prompt_cache(self.model), [])
        same = _common_prefix(held, token_ids, len(token_ids) - 1)  # feed >= 1 token
        trim_prompt_cache(cache, len(held) - same)
        feed, drafts, probs = token_ids[same:], [], []
        for i in range(k):
            logits = self.model(mx.array([feed]), cache=cache)[:, -1]
            if sampling.temperature > 0:  # q: its own distribution at the row's temperature
                probs.append(sampler.probabilities(logits, [sampling]))
                key = position_key(sampling, request_id, len(token_ids) + i, KEY_DRAFT)
                token = mx.random.categorical(mx.log(probs[-1]), key=key)
            else:
                token = mx.argmax(logits, axis=-1)
            drafts.append(int(token.item()))
            feed = drafts[-1:]
        self._held[request_id] = (cache, token_ids + drafts[:-1])
        return Draft(drafts, mx.concatenate(probs) if probs else None)

    def forget(self, request_id: int) -> None:
        self._held.pop(request_id, None)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

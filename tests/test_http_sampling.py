"""`batchsim serve` samples as its request fields say (the real server on loopback, tiny model):
each field applied (or refused with a 400 naming it), rows with different fields in one batch each
as asked, continuous usage stats, unique response ids, errors naming the field the client sent."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.serve_process import ServerProcess, stream_events

PROMPT = [5, 6, 7, 8, 9]  # token ids: the tiny model's greedy continuation of them repeats
BODY = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(batchsim_home):
    s = ServerProcess(batchsim_home, "--memory-gb", "0.002")
    yield s
    assert s.stop() == 0, "".join(s.stderr)


def complete(srv: ServerProcess, **fields) -> dict:
    r = srv.client.post("/v1/completions", json={**BODY, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def text(srv: ServerProcess, **fields) -> str:
    return complete(srv, **fields)["choices"][0]["text"]


def test_filters_that_keep_one_token_are_greedy(srv):
    greedy = text(srv)
    for seed in (1, 2, 3):
        hot = {"temperature": 1.5, "seed": seed}
        assert text(srv, **hot) != greedy  # sampling at this temperature does leave the argmax
        assert text(srv, **hot, top_k=1) == greedy
        assert text(srv, **hot, top_p=1e-9) == greedy
        assert text(srv, **hot, min_p=1.0) == greedy


def test_penalties_change_a_greedy_continuation(srv):
    greedy = text(srv)
    for field, value in (("presence_penalty", 2.0), ("frequency_penalty", 2.0),
                         ("repetition_penalty", 2.0)):
        assert text(srv, **{field: value}) != greedy, field
    assert text(srv, presence_penalty=-2.0) != text(srv, presence_penalty=2.0)


def test_logit_bias_and_stop_token_ids(srv):
    forced = complete(srv, logit_bias={"300": 100}, max_tokens=6)
    alone = complete(srv, prompt=[300] * 6, max_tokens=1, logit_bias={"300": 100})
    assert forced["choices"][0]["text"] == alone["choices"][0]["text"] * 6  # token 300, 6 times
    banned = complete(srv, logit_bias={"300": -100}, prompt=[300] * 6, max_tokens=1)
    assert banned["choices"][0]["text"] != alone["choices"][0]["text"]
    stopped = complete(srv, logit_bias={"300": 100}, stop_token_ids=[300])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1


def test_rows_with_different_fields_in_one_batch_each_take_effect(srv):
    """A greedy row keeps its tokens with sampled and penalized rows beside it, and a seeded
    sampled row draws what it draws alone."""
    fields = [{}, {"temperature": 1.0, "top_k": 20, "seed": 5},
              {"presence_penalty": 2.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 9}]
    bodies = [{**BODY, "max_tokens": 40, **f} for f in fields]
    alone = [text(srv, **b) for b in bodies]
    before = srv.metrics()

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json=b)
                                             for b in bodies))
        return [r.json()["choices"][0]["text"] for r in replies]

    batched = asyncio.run(together())
    after = srv.wait_idle()
    hist = "batchsim_decode_batch_size_steps"
    rows = after[f"{hist}_sum"] - before[f"{hist}_sum"]
    steps = after[f"{hist}_count"] - before[f"{hist}_count"]
    assert rows / steps > 2  # they did decode together
    assert batched == alone
    assert len(set(alone)) == 4  # and each field made a difference


def test_refused_and_out_of_range_fields_name_themselves(srv):
    cases = [("response_format", {"type": "json_object"}), ("min_tokens", 3),
             ("tools", [{"type": "function", "function": {"name": "f"}}]),
             ("top_p", 0), ("top_k", -2), ("min_p", 1.5), ("min_p", "x"),
             ("repetition_penalty", 0), ("frequency_penalty", 2.5), ("presence_penalty", -3),
             ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}), ("logit_bias", {"512": 1}),
             ("logit_bias", {"9" * 5000: 1}), ("logit_bias", [1]), ("stop_token_ids", [512]),
             ("logit_bias", {"01": 50, "1": 50}),  # both added to token 1 (100 past the limit)
             ("stop_token_ids", "1")]
    for field, value in cases:
        r = srv.client.post("/v1/completions", json={**BODY, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field, r.text
    ok = {"response_format": {"type": "text"}, "min_tokens": 0, "tools": [], "top_k": -1,
          "logit_bias": {}, "frequency_penalty": -2, "repetition_penalty": 1.0}
    assert complete(srv, **ok)["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "best_of", True), ("/v1/completions", "echo", 0),  # true is not 1
    ("/v1/chat/completions", "min_tokens", False), ("/v1/chat/completions", "top_logprobs", False),
    ("/v1/chat/completions", "tool_choice", "required"),  # no tools: it cannot be honoured
    ("/v1/chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("/v1/chat/completions", "function_call", {"name": "f"}),
    ("/v1/chat/completions", "messages", [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]}]),
])
def test_tool_fields_and_look_alike_types_are_refused(srv, path, field, value):
    """Each was a 200 that ignored the field (a template drops tool_calls; True == 1)."""
    plain = {**BODY, "messages": [{"role": "user", "content": "hi"}]}
    r = srv.client.post(path, json={**plain, field: value})
    assert r.status_code == 400, r.text
    param = "messages[1].tool_calls" if field == "messages" else field
    assert r.json()["error"]["param"] == param, r.text
    for harmless in ({"tool_choice": "auto"}, {"tool_choice": "none"}, {"best_of": 1}):
        assert srv.client.post(path, json={**plain, **harmless}).status_code == 200


@pytest.mark.parametrize("path,field,value,harmless", [
    ("/v1/chat/completions", "modalities", ["text", "audio"], ["text"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}, None),
    ("/v1/chat/completions", "reasoning_effort", "high", None),
    ("/v1/chat/completions", "web_search_options", {}, None),
    ("/v1/completions", "use_beam_search", True, False),
    ("/v1/completions", "allowed_token_ids", [5, 6], None),
    ("/v1/completions", "bad_words", ["the"], []),
    ("/v1/completions", "include_stop_str_in_output", True, False),
    ("/v1/completions", "guided_regex", "a+", None),
    ("/v1/chat/completions", "continue_final_message", True, False),
    ("/v1/chat/completions", "chat_template_kwargs", {"tokenize": False},
     {"enable_thinking": False}),
])
def test_fields_that_would_change_the_reply_are_refused(srv, path, field, value, harmless):
    """Each was a 200 that ignored the field (h8): a reply to some other request."""
    plain = {**BODY, "messages": [{"role": "user", "content": "hi"}]}
    r = srv.client.post(path, json={**plain, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
    assert srv.client.post(path, json={**plain, field: harmless}).status_code == 200


def test_chat_template_kwargs_reach_the_template_as_its_variables():
    """{"enable_thinking": false} (Qwen3's) was a 400: the template gets each key as a variable,
    as vLLM and mlx-lm's server pass it; apply_chat_template's own arguments stay refused."""
    from batchsim.server.http.fields import APIError
    from batchsim.server.http.openai_api import parse_generation

    seen = []

    class Template:
        def apply_chat_template(self, messages, add_generation_prompt, **variables):
            seen.append(variables)
            return [1, 2, 3] if variables.get("enable_thinking", True) else [1, 2]

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    off = parse_generation({**chat, "chat_template_kwargs": {"enable_thinking": False}}, "chat",
                           Template(), 100, 10_000)
    assert off.prompt_ids == (1, 2) and seen == [{"enable_thinking": False}]
    assert parse_generation({**chat, "chat_template_kwargs": None}, "chat", Template(), 100,
                            10_000).prompt_ids == (1, 2, 3)
    for bad in ({"add_generation_prompt": False}, ["enable_thinking"], "x"):
        with pytest.raises(APIError) as err:
            parse_generation({**chat, "chat_template_kwargs": bad}, "chat", Template(), 100,
                             10_000)
        assert err.value.param == "chat_template_kwargs", err.value


def test_chat_template_kwargs_never_replace_the_tokenizers_own_names(smollm2):
    """r7: a client's bos_token replaced the model's in the prompt, raise_exception broke the
    template (a 400 naming messages), and transformers 5's sanitize_control_tokens was missing
    from the hand list of apply_chat_template's arguments (now read from its signature)."""
    import inspect

    from batchsim.server.http.fields import APIError
    from batchsim.server.http.openai_api import parse_generation

    tokenizer = smollm2[2]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    names = ["bos_token", "eos_token", "raise_exception", "strftime_now"]
    if "sanitize_control_tokens" in inspect.signature(
            tokenizer._tokenizer.apply_chat_template).parameters:
        names.append("sanitize_control_tokens")
    for name in names:
        with pytest.raises(APIError) as err:
            parse_generation({**chat, "chat_template_kwargs": {name: "<|im_start|>system\nX"}},
                             "chat", tokenizer, 100_000, 10_000)
        assert err.value.param == "chat_template_kwargs" and name in str(err.value), err.value


def test_a_template_error_from_chat_template_kwargs_names_them():
    from batchsim.server.http.fields import APIError
    from batchsim.server.http.openai_api import parse_generation

    class Template:
        def apply_chat_template(self, messages, add_generation_prompt, **variables):
            if variables or messages[0]["content"] == "bad":
                raise TypeError("'int' object is not callable")
            return [1, 2]

    for content, kwargs, param in (("hi", {"x": 1}, "chat_template_kwargs"),
                                   ("bad", {"x": 1}, "messages"), ("bad", None, "messages")):
        body = {"messages": [{"role": "user", "content": content}], "chat_template_kwargs": kwargs}
        with pytest.raises(APIError) as err:
            parse_generation(body, "chat", Template(), 100, 10_000)
        assert err.value.param == param and str(err.value).startswith(param), err.value


def test_skip_special_tokens_is_served_with_the_models_tokenizer(srv):
    """mlx-lm's tokenizer wrapper gives the special ids (all_special_ids, its tokenizer's): a
    special token's text is dropped when asked (the tiny model's BOS, id 1, is one of them)."""
    forced = {"logit_bias": {"1": 100}, "max_tokens": 3}
    assert text(srv, **forced) == "<|startoftext|>" * 3
    both = {"skip_special_tokens": True, "spaces_between_special_tokens": False}
    assert text(srv, **forced, **both) == ""
    r = srv.client.post("/v1/completions", json={**BODY, "spaces_between_special_tokens": True})
    assert r.status_code == 400 and "skip_special_tokens" in r.json()["error"]["message"]


def test_context_overflow_names_the_field_sent(srv):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for field in ("max_tokens", "max_completion_tokens"):
        r = srv.client.post("/v1/chat/completions", json={**chat, field: 10**6})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == field
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_continuous_usage_stats_put_usage_on_every_chunk(srv):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = stream_events(srv, "/v1/completions", {**BODY, "stream_options": options})
    chunks = [e.json() for e in events if not e.is_done]
    assert len(chunks) >= 3 and all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 24
    assert chunks[-1]["choices"] == [] and chunks[-2]["usage"] == chunks[-1]["usage"]
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in chunks)
    plain = stream_events(srv, "/v1/completions", {**BODY, "stream_options": {
        "include_usage": True}})
    assert all(e.json()["usage"] is None for e in plain[:-2])  # OpenAI's: null but the last
    alone = stream_events(srv, "/v1/completions", {**BODY, "stream_options": {
        "continuous_usage_stats": True}})  # as vLLM: only with include_usage
    assert all("usage" not in e.json() for e in alone[:-1])


def test_response_ids_are_unique_across_processes(srv, batchsim_home):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    other = ServerProcess(batchsim_home, "--memory-gb", "0.002")
    try:
        ids = [s.client.post("/v1/chat/completions", json=chat).json()["id"]
               for s in (srv, other, srv, other)]
        ids.append(srv.client.post("/v1/completions", json=BODY).json()["id"])
    finally:
        assert other.stop() == 0
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids[:4])
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", ids[4])
    events = stream_events(srv, "/v1/chat/completions", chat)
    assert len({e.json()["id"] for e in events[:-1]}) == 1  # one id for every chunk


def test_integers_past_a_floats_range_are_400s_naming_the_field():
    """10**400 in a number field, or 5,000 digits anywhere, was a 500 (OverflowError, and
    Python's 4,300-digit limit); no server needed."""
    from batchsim.server.http.fields import APIError
    from batchsim.server.http.openai_api import parse_json_object
    from batchsim.server.http.sampling_fields import parse_sampling

    huge = 10**400
    for field, value in [("temperature", huge), ("top_p", huge), ("min_p", huge),
                         ("repetition_penalty", huge), ("frequency_penalty", -huge),
                         ("presence_penalty", huge), ("logit_bias", {"1": huge})]:
        with pytest.raises(APIError) as exc:
            parse_sampling({field: value}, 512)
        assert exc.value.status == 400 and exc.value.param == field, (field, exc.value)
    with pytest.raises(APIError) as exc:
        parse_json_object(b'{"max_tokens": 1' + b"0" * 5000 + b"}")
    assert exc.value.status == 400 and "not valid JSON" in exc.value.message

"""The OpenAI API surface of `batchsim serve`: request bodies parsed and checked into plain data,
the response and stream-chunk shapes, and OpenAI-style errors. No HTTP and no engine here."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Literal

Kind = Literal["completion", "chat"]
# OpenAI's legacy default for completions; chat defaults to the rest of the context, capped here so
# a chat without max_tokens on a random-weight model does not run thousands of tokens.
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 512}
MAX_STOP_STRINGS = 16
SEED_RANGE = 2**32  # seeds are reduced modulo this: the executor folds them into a 64-bit key
_ROLES = ("system", "developer", "user", "assistant", "tool")
# Below this a temperature is greedy, as vLLM's _SAMPLING_EPS: logits / 1e-39 overflow to inf and
# the draw turns uniform instead of sharp.
MIN_TEMPERATURE = 1e-5


class APIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """One checked request: what to generate and how to answer."""

    kind: Kind
    prompt_ids: tuple[int, ...]
    max_tokens: int | None  # None: not given (the server picks a default that fits the context)
    temperature: float
    seed: int | None
    stop: tuple[str, ...]  # stop strings; the text ends before the first match
    ignore_eos: bool
    stream: bool
    include_usage: bool  # stream: a last chunk with `usage` and empty `choices`


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object of valid Unicode text (no lone surrogates, as bytes or as \\u
    escapes, which tokenizers cannot encode); anything else is a 400."""
    try:
        body = json.loads(raw.decode(json.detect_encoding(raw)))  # strict, unlike json.loads(bytes)
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate escape fails here
    except UnicodeError as exc:
        raise APIError(400, f"request body is not valid Unicode text: {exc}") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _get(body: dict[str, Any], key: str, default: Any) -> Any:
    """A field's value; an explicit null means the default, as OpenAI's API treats it."""
    value = body.get(key)
    return default if value is None else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _field(body: dict[str, Any], key: str, ok: bool, rule: str) -> None:
    if not ok:
        raise APIError(400, f"{key}: must be {rule}, got {json.dumps(body.get(key))[:80]}",
                       param=key)


def check_model(body: dict[str, Any], served_name: str) -> None:
    model = body.get("model")
    _field(body, "model", model is None or isinstance(model, str), "a string")
    if model is not None and model != served_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served_name!r}", param="model", code="model_not_found")


def parse_generation(body: dict[str, Any], kind: Kind, tokenizer: Any, vocab_size: int,
                     max_prompt_bytes: int) -> GenerationParams:
    """Check every field batchsim honours or refuses; unknown fields are ignored, as OpenAI's
    clients send extras (user, ...). Tokenizes the prompt: call it off the event loop."""
    _check_unsupported(body, kind)
    stream = _get(body, "stream", False)
    _field(body, "stream", isinstance(stream, bool), "a boolean")
    options = body.get("stream_options")
    _field(body, "stream_options", options is None or isinstance(options, dict), "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError(400, "stream_options: only allowed with stream=true",
                           param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise APIError(400, "stream_options.include_usage: must be a boolean",
                           param="stream_options.include_usage")
    # The newer name wins unless it is null.
    chat_key = kind == "chat" and body.get("max_completion_tokens") is not None
    key = "max_completion_tokens" if chat_key else "max_tokens"
    max_tokens = body.get(key)
    _field(body, key, max_tokens is None or (_is_int(max_tokens) and max_tokens >= 1),
           "an integer >= 1")
    temperature = _get(body, "temperature", 0.0)
    _field(body, "temperature", _is_number(temperature) and temperature >= 0, "a number >= 0")
    _check_nucleus(body)
    seed = body.get("seed")
    _field(body, "seed", seed is None or (_is_int(seed) and -(2**63) <= seed < 2**63),
           "a 64-bit integer")
    ignore_eos = _get(body, "ignore_eos", False)
    _field(body, "ignore_eos", isinstance(ignore_eos, bool), "a boolean")
    if kind == "chat":
        prompt_ids = _chat_prompt(body, tokenizer, max_prompt_bytes)
    else:
        prompt_ids = _completion_prompt(body, tokenizer, max_prompt_bytes)
    if not prompt_ids:
        raise APIError(400, "prompt: encodes to no tokens", param="prompt")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise APIError(400, f"prompt: token ids must be in [0, {vocab_size})", param="prompt")
    greedy = temperature < MIN_TEMPERATURE
    return GenerationParams(kind, tuple(prompt_ids), max_tokens,
                            0.0 if greedy else float(temperature),
                            None if seed is None else seed % SEED_RANGE, _stop_strings(body),
                            ignore_eos, stream, include_usage)


def _check_unsupported(body: dict[str, Any], kind: Kind) -> None:
    n = body.get("n", 1)
    _field(body, "n", n is None or (_is_int(n) and n == 1), "1 (one choice per request)")
    refused = {"best_of": (None, 1), "echo": (None, False), "suffix": (None,),
               "logprobs": (None, False) if kind == "chat" else (None,),
               "top_logprobs": (None, 0)}
    for key, allowed in refused.items():
        if key in body and body[key] not in allowed:
            raise APIError(400, f"{key}: not supported by batchsim serve", param=key)


def _check_nucleus(body: dict[str, Any]) -> None:
    """top_p and top_k are accepted in vLLM's ranges (and not applied: batchsim samples from the
    whole distribution); outside them they are a 400, as in vLLM."""
    top_p = _get(body, "top_p", 1.0)
    _field(body, "top_p", _is_number(top_p) and 0 < top_p <= 1, "a number in (0, 1]")
    top_k = _get(body, "top_k", 0)
    _field(body, "top_k", _is_int(top_k) and top_k >= -1, "-1 or 0 (off) or an integer >= 1")


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    _field(body, "stop", isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
           and all(isinstance(s, str) and s for s in stop),
           f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return tuple(stop)


def _check_prompt_bytes(num_bytes: int, max_bytes: int, param: str) -> None:
    if num_bytes > max_bytes:
        raise APIError(413, f"{param}: {num_bytes} bytes of text exceed this server's limit of "
                       f"{max_bytes} (serve --max-prompt-bytes)", param=param,
                       code="prompt_too_large")


def _completion_prompt(body: dict[str, Any], tokenizer: Any, max_bytes: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        _check_prompt_bytes(len(prompt.encode()), max_bytes, "prompt")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise APIError(400, "prompt: one prompt per request (send several requests)",
                       param="prompt")
    raise APIError(400, "prompt: required; a non-empty string or a list of token ids",
                   param="prompt")


def _chat_prompt(body: dict[str, Any], tokenizer: Any, max_bytes: int) -> list[int]:
    messages = body.get("messages")
    _field(body, "messages", isinstance(messages, list) and bool(messages),
           "a non-empty list of messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise APIError(400, f"messages[{i}]: an object with a role in {', '.join(_ROLES)}",
                           param=f"messages[{i}]")
        plain.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    _check_prompt_bytes(sum(len(m["content"].encode()) for m in plain), max_bytes, "messages")
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    except Exception as exc:  # a template may raise on a role order it does not accept
        raise APIError(400, f"messages: the chat template rejected them: {exc}",
                       param="messages") from None
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _message_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"messages[{i}].content: a string or a list of text parts",
                   param=f"messages[{i}].content")


# -- responses -----------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0}}  # no prefix cache: nothing reused


def response_id(kind: Kind, request_id: int) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def _head(kind: Kind, request_id: int, created: int, model: str, stream: bool) -> dict[str, Any]:
    obj = "text_completion" if kind == "completion" else (
        "chat.completion.chunk" if stream else "chat.completion")
    return {"id": response_id(kind, request_id), "object": obj, "created": created, "model": model}


def full_response(kind: Kind, request_id: int, created: int, model: str, text: str,
                  finish_reason: str | None, usage_counts: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(kind, request_id, created, model, False), "choices": [choice],
            "usage": usage_counts}


def stream_chunk(kind: Kind, request_id: int, created: int, model: str, text: str,
                 finish_reason: str | None, *, first: bool, include_usage: bool) -> dict[str, Any]:
    """One chunk of new text (the server sends none empty but the last, which carries the
    finish_reason). In chat the first one also carries the role."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    chunk = {**_head(kind, request_id, created, model, True), "choices": [choice]}
    if include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last
    return chunk


def usage_chunk(kind: Kind, request_id: int, created: int, model: str,
                usage_counts: dict[str, Any]) -> dict[str, Any]:
    return {**_head(kind, request_id, created, model, True), "choices": [], "usage": usage_counts}

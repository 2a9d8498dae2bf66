"""The OpenAI API surface of `batchsim serve`: request bodies parsed and checked into plain data
(sampling fields: sampling_fields.py; errors and field checks: fields.py) and the response and
stream-chunk shapes. No HTTP and no engine here."""

from __future__ import annotations

import dataclasses
import inspect
import json
import uuid
from typing import Any, Literal

from batchsim.scheduler.request import SamplingParams
from batchsim.server.http.fields import APIError, check, get, is_int
from batchsim.server.http.sampling_fields import parse_sampling

Kind = Literal["completion", "chat"]
# OpenAI's legacy default for completions; chat defaults to the rest of the context, capped here so
# a chat without max_tokens on a random-weight model does not run thousands of tokens.
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 512}
MAX_STOP_STRINGS = 16
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """One checked request: what to generate and how to answer."""

    kind: Kind
    prompt_ids: tuple[int, ...]
    max_tokens: int | None  # None: not given (the server picks a default that fits the context)
    sampling: SamplingParams  # every sampling field; its max_tokens is set when admitted
    stop: tuple[str, ...]  # stop strings; the text ends before the first match
    stream: bool
    include_usage: bool  # stream: a last chunk with `usage` and empty `choices`
    continuous_usage: bool = False  # stream: `usage` so far on every chunk (vLLM's option)
    max_tokens_param: str = "max_tokens"  # the field that set max_tokens (errors name it)
    skip_special_tokens: bool = False  # vLLM's: no special token's text (EOS never has text)


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
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4,300 digits
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict[str, Any], served_name: str) -> None:
    model = body.get("model")
    check(body, "model", model is None or isinstance(model, str), "a string")
    if model is not None and model != served_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served_name!r}", param="model", code="model_not_found")


def parse_generation(body: dict[str, Any], kind: Kind, tokenizer: Any, vocab_size: int,
                     max_prompt_bytes: int, reserved_names: frozenset[str] | None = None
                     ) -> GenerationParams:
    """Check every field batchsim honours or refuses; unknown fields are ignored, as OpenAI's
    clients send extras (user, ...). Tokenizes the prompt: call it off the event loop.
    `reserved_names`: template_reserved_names(tokenizer), if the caller keeps it (else read)."""
    _check_unsupported(body, kind)
    stream = get(body, "stream", False)
    check(body, "stream", isinstance(stream, bool), "a boolean")
    include_usage, continuous_usage = _stream_options(body, stream)
    # The newer name wins unless it is null.
    chat_key = kind == "chat" and body.get("max_completion_tokens") is not None
    key = "max_completion_tokens" if chat_key else "max_tokens"
    max_tokens = body.get(key)
    check(body, key, max_tokens is None or (is_int(max_tokens) and max_tokens >= 1),
          "an integer >= 1")
    sampling = parse_sampling(body, vocab_size)
    if kind == "chat":
        prompt_ids = _chat_prompt(body, tokenizer, max_prompt_bytes, reserved_names)
    else:
        prompt_ids = _completion_prompt(body, tokenizer, max_prompt_bytes)
    if not prompt_ids:
        raise APIError(400, "prompt: encodes to no tokens", param="prompt")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise APIError(400, f"prompt: token ids must be in [0, {vocab_size})", param="prompt")
    return GenerationParams(kind, tuple(prompt_ids), max_tokens, sampling, _stop_strings(body),
                            stream, include_usage, continuous_usage, key, _skip_special(body))


def _skip_special(body: dict[str, Any]) -> bool:
    """skip_special_tokens, honoured (default false: the text as mlx-lm's detokenizer writes it,
    special tokens included). spaces_between_special_tokens false, or either value with
    skip_special_tokens: mlx-lm's streaming detokenizers concatenate shown special tokens' text
    ('<|a|><|b|>', checked on smollm2 and tiny), as false asks; true asks for spaces."""
    skip = get(body, "skip_special_tokens", False)
    check(body, "skip_special_tokens", isinstance(skip, bool), "a boolean")
    spaces = body.get("spaces_between_special_tokens")
    ok = spaces in (None, False) or skip and isinstance(spaces, bool)
    check(body, "spaces_between_special_tokens", ok, "false or null unless skip_special_tokens "
          "is true (batchsim serve joins special tokens' text with no space, as its detokenizer "
          "does)")
    return skip


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); the second, vLLM's, counts only with the first."""
    options = body.get("stream_options")
    check(body, "stream_options", options is None or isinstance(options, dict), "an object")
    if options is None:
        return False, False
    if not stream:
        raise APIError(400, "stream_options: only allowed with stream=true",
                       param="stream_options")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = get(options, name, False)
        if not isinstance(value, bool):
            raise APIError(400, f"stream_options.{name}: must be a boolean",
                           param=f"stream_options.{name}")
        flags.append(value)
    return flags[0], flags[0] and flags[1]


# Fields OpenAI or vLLM accept that would change the reply, refused unless they ask for what
# serve does anyway: a 200 that ignored one would answer a different request.
_CHANGES_OUTPUT: dict[str, tuple[Any, ...]] = {
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,), "verbosity": (None,),  # OpenAI: reasoning models only
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,), "bad_words": (None, []), "truncate_prompt_tokens": (None,),
    "include_stop_str_in_output": (None, False), "prompt_logprobs": (None,),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "documents": (None,),
}
# chat_template_kwargs go to the template as its variables ({"enable_thinking": false}: Qwen3),
# except apply_chat_template's own arguments (its signature), the conversation, the tokenizer's
# special tokens (a client's bos_token replaced the model's in the prompt) and the template's
# helpers (transformers' jinja globals).
_TEMPLATE_OWN = frozenset(("messages", "raise_exception", "strftime_now"))


def template_reserved_names(tokenizer: Any) -> frozenset[str]:
    """The names chat_template_kwargs may not take (read once per tokenizer: Server's)."""
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    named = set(_TEMPLATE_OWN) | {*special}
    # mlx-lm's wrapper passes its **kwargs on to its HF tokenizer's apply_chat_template
    for tok in (tokenizer, getattr(tokenizer, "__dict__", {}).get("_tokenizer")):
        if callable(apply := getattr(tok, "apply_chat_template", None)):
            params = inspect.signature(apply).parameters.values()
            named |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(named)


def _check_unsupported(body: dict[str, Any], kind: Kind) -> None:
    n = body.get("n", 1)
    check(body, "n", n is None or (is_int(n) and n == 1), "1 (one choice per request)")
    refused = {"best_of": (None, 1), "echo": (None, False), "suffix": (None,),
               "logprobs": (None, False) if kind == "chat" else (None,),
               "top_logprobs": (None, 0), "min_tokens": (None, 0), "tools": (None, []),
               "functions": (None, []), "tool_choice": (None, "none", "auto"),
               "function_call": (None, "none", "auto"),  # without tools these two are no-ops
               **_CHANGES_OUTPUT}
    for key, allowed in refused.items():
        if key in body and not _one_of(body[key], allowed):
            raise APIError(400, f"{key}: not supported by batchsim serve", param=key)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise APIError(400, 'response_format: only {"type": "text"}; batchsim serve has no '
                       "structured output", param="response_format")


def _one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value` equals one of `allowed` and has its type (true is not 1, 0 is not false)."""
    return any(value == a and type(value) is type(a) for a in allowed)


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    check(body, "stop", isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
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
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise APIError(400, "prompt: one prompt per request (send several requests)",
                       param="prompt")
    raise APIError(400, "prompt: required; a non-empty string or a list of token ids",
                   param="prompt")


def _chat_prompt(body: dict[str, Any], tokenizer: Any, max_bytes: int,
                 reserved_names: frozenset[str] | None) -> list[int]:
    messages = body.get("messages")
    check(body, "messages", isinstance(messages, list) and bool(messages),
           "a non-empty list of messages")
    plain = [_plain_message(m, i) for i, m in enumerate(messages)]
    _check_prompt_bytes(sum(len(m["content"].encode()) for m in plain), max_bytes, "messages")
    variables = get(body, "chat_template_kwargs", {})
    check(body, "chat_template_kwargs", isinstance(variables, dict),
          "an object of the chat template's variables (such as {\"enable_thinking\": false})")
    if variables:
        reserved = (template_reserved_names(tokenizer) if reserved_names is None
                    else reserved_names)
        if refused := sorted(variables.keys() & reserved):
            raise APIError(400, f"chat_template_kwargs: {', '.join(refused)[:200]} not a template "
                           "variable here (apply_chat_template's argument, the messages, a special "
                           "token or a template helper)", param="chat_template_kwargs")
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, **variables)
    except Exception as exc:  # noqa: BLE001 - a template may refuse a role order
        field = "chat_template_kwargs" if variables and _renders(tokenizer, plain) else "messages"
        raise APIError(400, f"{field}: the chat template rejected them: {exc}",
                       param=field) from None
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _renders(tokenizer: Any, plain: list[dict[str, str]]) -> bool:
    """Whether the template takes these messages without chat_template_kwargs (which to blame)."""
    try:
        tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - the messages' own error
        return False
    return True


def _plain_message(m: Any, i: int) -> dict[str, str]:
    """messages[i] as the chat template takes it: its role and text."""
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise APIError(400, f"messages[{i}]: an object with a role in {', '.join(_ROLES)}",
                       param=f"messages[{i}]")
    for key in ("tool_calls", "function_call"):  # the template would drop them unsaid
        if m.get(key):
            raise APIError(400, f"messages[{i}].{key}: not supported by batchsim serve",
                           param=f"messages[{i}].{key}")
    return {"role": m["role"], "content": _message_text(m.get("content"), i)}


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
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """`cached_tokens`: prompt tokens the prefix cache held when the request was admitted."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_response_id(kind: Kind) -> str:
    """Unique across requests and processes, as vLLM's (`chatcmpl-<uuid4 hex>`)."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def _head(kind: Kind, response_id: str, created: int, model: str, stream: bool) -> dict[str, Any]:
    obj = "text_completion" if kind == "completion" else (
        "chat.completion.chunk" if stream else "chat.completion")
    return {"id": response_id, "object": obj, "created": created, "model": model}


def full_response(kind: Kind, response_id: str, created: int, model: str, text: str,
                  finish_reason: str | None, usage_counts: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(kind, response_id, created, model, False), "choices": [choice],
            "usage": usage_counts}


def stream_chunk(kind: Kind, response_id: str, created: int, model: str, text: str,
                 finish_reason: str | None, *, first: bool, include_usage: bool,
                 usage_counts: dict[str, Any] | None = None) -> dict[str, Any]:
    """One chunk of new text (the server sends none empty but the last, which carries the
    finish_reason). In chat the first one also carries the role. With include_usage, `usage` is
    null (OpenAI) or, with continuous usage stats, the counts so far (vLLM)."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    chunk = {**_head(kind, response_id, created, model, True), "choices": [choice]}
    if include_usage:
        chunk["usage"] = usage_counts
    return chunk


def usage_chunk(kind: Kind, response_id: str, created: int, model: str,
                usage_counts: dict[str, Any]) -> dict[str, Any]:
    return {**_head(kind, response_id, created, model, True), "choices": [], "usage": usage_counts}

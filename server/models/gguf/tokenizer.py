"""tokenizer.json and tokenizer_config.json rebuilt from a GGUF's `tokenizer.*` metadata with the
`tokenizers` package: GPT-2 byte-level BPE, the file's merges, and its pre-tokenizer."""

from __future__ import annotations

import json
from typing import Any

from batchsim.server.models.gguf.reader import Gguf, GgufError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types written as added tokens
SPECIAL_ROLES = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.{role}_token_id
# tokenizer.ggml.pre -> split digits one by one before the byte-level regex (SmolLM's tokenizer)
PRE_TOKENIZERS = {"smollm": True, "default": False, "gpt-2": False, "gpt2": False}


def _pre_tokenizer(g: Gguf) -> Any:
    from tokenizers import pre_tokenizers

    pre = g.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GgufError(f"{g.path}: pre-tokenizer {pre!r} is not supported; supported: "
                        f"{', '.join(PRE_TOKENIZERS)}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if not PRE_TOKENIZERS[pre]:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def _chat_template(g: Gguf) -> str | None:
    """The chat template, compiled as transformers compiles it (a broken one failed in `run`)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = g.value("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GgufError(f"{g.path}: tokenizer.chat_template must be a string, got {template!r}")
    try:
        if template:
            ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise GgufError(f"{g.path}: tokenizer.chat_template is not a Jinja template "
                        f"(line {exc.lineno}: {exc.message})") from None
    return template or None


def build_tokenizer(g: Gguf) -> Any:
    """A `tokenizers.Tokenizer` equal to the one the GGUF was converted from."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = g.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(f"{g.path}: tokenizer model {kind!r} is not supported; supported: gpt2 "
                        "(byte-level BPE)")
    tokens = g.strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in g.strings("tokenizer.ggml.merges")]
    types = _token_types(g, tokens)
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    except Exception as exc:  # noqa: BLE001 - `tokenizers` raises a bare Exception
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GgufError(f"{g.path}: tokenizer metadata does not make a BPE tokenizer "
                        f"({reason})") from None
    tok.pre_tokenizer = _pre_tokenizer(g)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


def _token_types(g: Gguf, tokens: list[str]) -> list[int]:
    """One llama.cpp type per token: a scalar type was a TypeError traceback, a short list left
    tokens unmarked."""
    types = g.value("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens) or not all(
            isinstance(t, int) for t in types):
        raise GgufError(f"{g.path}: tokenizer.ggml.token_type must be an array of "
                        f"{len(tokens)} integers (one per token), got {str(types)[:40]}")
    _check_specials_kept(g, tokens, types)
    return types


def _check_specials_kept(g: Gguf, tokens: list[str], types: list[int]) -> None:
    """A string listed twice reads as its last id, as llama.cpp's token_to_id (an earlier id has
    no string of its own in a BPE vocabulary; real vocabularies repeat some): refused only where
    either id is a special one (a role's, or a CONTROL or USER_DEFINED token, which
    add_special_tokens and add_tokens would map to the later id): an end-of-sequence, or a
    turn's end such as <|eot_id|>, would decode to nothing; a normal token's text repeated
    later as a control token would read as that control token in a prompt."""
    last = {t: i for i, t in enumerate(tokens)}
    for role in SPECIAL_ROLES:
        idx = g.value(f"tokenizer.ggml.{role}_token_id")
        if isinstance(idx, int) and 0 <= idx < len(tokens) and last[tokens[idx]] != idx:
            raise GgufError(f"{g.path}: tokenizer.ggml.{role}_token_id {idx} is "
                            f"{tokens[idx]!r}, listed again as id {last[tokens[idx]]}: the "
                            "string would read as that id, not the special one")
    first: dict[str, int] = {}
    for idx, t in enumerate(tokens):
        first.setdefault(t, idx)
    for idx, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED) and first[t] != last[t]:  # listed more than once
            other = last[t] if last[t] != idx else first[t]  # a later id, else an earlier one
            kinds = {CONTROL: "control", USER_DEFINED: "user-defined"}
            listed = "is listed again" if other > idx else "is also listed"  # earlier: id `other`
            reads = ("that id, not the special one" if other > idx else
                     "the special one, not that id")  # a normal token's text would be special
            raise GgufError(f"{g.path}: token {idx} {t!r} ({kinds[ty]}) {listed} as id {other} "
                            f"({kinds.get(types[other], 'a normal token')}): the string would "
                            f"read as {reads}")


def _flag(g: Gguf, key: str) -> bool:
    """A boolean: the string "false" read as bool() was true (a BOS added to every prompt)."""
    value = g.value(key, False)
    if not isinstance(value, bool):
        raise GgufError(f"{g.path}: {key} must be a boolean, got {str(value)[:40]}")
    return value


def tokenizer_config(g: Gguf) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name, the chat template, no added BOS unless
    asked."""
    tokens = g.strings("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(g.value("llama.context_length") or 4096),
        "add_bos_token": _flag(g, "tokenizer.ggml.add_bos_token"),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }
    for role in SPECIAL_ROLES:
        idx = g.value(f"tokenizer.ggml.{role}_token_id")
        if idx is not None:
            key = {"unknown": "unk", "padding": "pad"}.get(role, role)
            config[f"{key}_token"] = tokens[int(idx)]
    if template := _chat_template(g):
        config["chat_template"] = template
    return config


def tokenizer_files(g: Gguf) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json as text, built (and so checked) before writing."""
    return {"tokenizer.json": build_tokenizer(g).to_str(pretty=True),  # as Tokenizer.save writes
            "tokenizer_config.json": json.dumps(tokenizer_config(g), indent=1)}

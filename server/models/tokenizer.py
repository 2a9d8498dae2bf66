"""A byte-level BPE tokenizer built locally to a model's exact vocabulary size, so every token id a
random-weight model can emit decodes to text and mlx-lm's loader treats it like a real
checkpoint."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def special_token_ids(tokenizer: object) -> frozenset[int] | None:
    """The tokenizer's special token ids (all_special_ids, worked out on each read: read once),
    or None where it names none (no such attribute, or no tokenizer)."""
    ids = getattr(tokenizer, "all_special_ids", None)
    return None if ids is None else frozenset(ids)


def _special_tokens(vocab_size: int, bos_id: int, eos_id: int) -> dict[int, str]:
    specials = {eos_id: "<|endoftext|>"}
    if bos_id != eos_id:
        specials[bos_id] = "<|startoftext|>"
    for name in ("<|im_start|>", "<|im_end|>"):
        free = next(i for i in range(vocab_size - 1, -1, -1) if i not in specials)
        specials[free] = name
    return specials


def _regular_tokens(count: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte symbols, then pair and triple merges of them, until `count` tokens exist."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if count < len(alphabet):
        raise ValueError(f"vocab too small for a byte-level tokenizer: {count} < {len(alphabet)}")
    tokens = list(alphabet)
    merges: list[tuple[str, str]] = []
    seen = set(tokens)
    pairs = ((a, b) for a, b in itertools.product(alphabet, alphabet))
    triples = ((a + b, c) for a, b, c in itertools.product(alphabet, alphabet, alphabet))
    for left, right in itertools.chain(pairs, triples):
        if len(tokens) >= count:
            break
        merged = left + right
        if merged in seen:
            continue
        seen.add(merged)
        tokens.append(merged)
        merges.append((left, right))
    return tokens, merges


def build_tokenizer(out_dir: Path, vocab_size: int, bos_id: int, eos_id: int, max_len: int) -> None:
    """Write tokenizer.json and tokenizer_config.json with exactly `vocab_size` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = _special_tokens(vocab_size, bos_id, eos_id)
    regular, merges = _regular_tokens(vocab_size - len(specials))
    free_ids = (i for i in range(vocab_size) if i not in specials)
    vocab = {tok: i for tok, i in zip(regular, free_ids)}
    vocab.update({name: i for i, name in specials.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in specials.values()])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[bos_id],
        "eos_token": specials[eos_id],
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    """token -> id of a model directory's tokenizer.json, its added tokens included (None: none
    there, or one this cannot read: a sentencepiece-only model)."""
    try:
        data = json.loads((model_dir / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        ids = ({tok: i for i, (tok, _) in enumerate(vocab)} if isinstance(vocab, list)  # unigram
               else dict(vocab))
        ids.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ids


def check_shared_tokenizer(draft_dir: Path, target_dir: Path, draft: str, target: str) -> None:
    """A one-line error when both models' tokenizer.json map tokens to different ids (the
    vocabulary's size alone is checked before: spec_price.check_draft_model)."""
    from batchsim.configs import ConfigError

    theirs, ours = tokenizer_vocab(draft_dir), tokenizer_vocab(target_dir)
    if theirs is None or ours is None or theirs == ours:
        return
    moved = sum(theirs.get(tok) != i for tok, i in ours.items())
    raise ConfigError(f"--draft-model {draft}: its tokenizer gives {moved} of {target}'s "
                      f"{len(ours)} tokens other ids (or none); a draft model must share the "
                      "tokenizer")

"""Real-text chat traffic: user prompts from a YAML file, sent through the model's chat template
with EOS honoured and sampling as chat clients send it, so outputs end where the model ends them.
The settings are `chat:` in a workload YAML (configs/workloads/chat.yaml)."""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from batchsim.configs import CONFIG_DIR, ConfigError, load_yaml

PROMPTS_DIR = CONFIG_DIR / "workloads" / "prompts"


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    """Prompts and sampling of a chat workload; arrivals still come from the workload."""

    # YAML with `prompts: [text, ...]`: absolute, or relative to configs/workloads/prompts
    prompts: str
    temperature: float = 0.7  # what chat UIs commonly send; 0 = greedy
    top_p: float = 1.0  # accepted for the record; the executor samples from the full distribution
    max_tokens: int = 512  # the client's cap; EOS ends most replies before it

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"chat.temperature: must be >= 0, got {self.temperature!r}")
        if self.top_p != 1.0:
            raise ConfigError("chat.top_p: only 1.0 (the executor samples the full distribution)")
        if self.max_tokens < 1:
            raise ConfigError(f"chat.max_tokens: must be >= 1, got {self.max_tokens!r}")


def prompts_path(name: str) -> Path:
    path = Path(name).expanduser()
    path = path if path.is_absolute() else PROMPTS_DIR / path
    if not path.is_file():
        raise ConfigError(f"chat.prompts: no such file {path}")
    return path


@lru_cache(maxsize=8)
def load_prompts(name: str) -> tuple[str, ...]:
    """The prompt texts; a file without a non-empty `prompts` list of strings is an error."""
    path = prompts_path(name)
    data = load_yaml(path)
    texts = data.get("prompts")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ConfigError(f"{path}: `prompts` must be a non-empty list of strings")
    return tuple(texts)


def prompt_text(chat: ChatSpec, index: int) -> str:
    """Request `index`'s prompt: the file's prompts in order, cycled."""
    texts = load_prompts(chat.prompts)
    return texts[index % len(texts)]


def chat_token_ids(tokenizer: Any, text: str) -> list[int]:
    """One user turn with the generation prompt, as a chat endpoint tokenizes it."""
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

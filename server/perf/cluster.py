"""N Macs decoding one model: the link between them (configs/links.yaml) and what splitting the
model costs and saves per step.

Tensor parallel (mlx-lm's `model.shard()`, exo): every linear layer, expert and attention head is
split across the ranks, so each rank streams 1/N of the weights and reads 1/N of the K/V (MLA's
latent cache is not split by heads: every rank holds all of it); embeddings and the lm head stay
whole; each layer ends its attention and its MLP with an all-reduce of rows x hidden activations.
Pipeline (mlx-lm's `pipeline()`): each rank holds 1/N of the layers and a token passes through
them in turn, so one batch's step costs what it costs on one Mac plus N-1 sends (the other ranks
idle meanwhile: the bubble); it splits memory, not time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from batchsim.configs import ConfigError, from_dict, load_yaml
from batchsim.server.models.spec import ModelSpec, dtype_bytes

LINKS_PATH = Path(__file__).resolve().parents[2] / "configs" / "links.yaml"
PARALLEL = ("tensor", "pipeline")
ALL_REDUCES_PER_LAYER = 2  # after attention's output projection and after the MLP's down projection


@dataclasses.dataclass(frozen=True)
class Link:
    key: str
    name: str
    transport: str  # tcp | rdma
    topology: str  # ring: each rank talks to its two neighbours; mesh: a cable to every other rank
    bandwidth_gbs: float  # GB/s one way, usable by a message
    latency_us: float  # per message
    source: str

    def send_s(self, nbytes: float) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * 1e9)

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        """Ring: reduce-scatter then all-gather, 2 (N-1) messages of nbytes / N in turn. Mesh:
        every rank sends its whole vector to every other at once (one message time) and sums."""
        if ranks <= 1:
            return 0.0
        if self.topology == "mesh":
            return self.send_s(nbytes)
        return 2 * (ranks - 1) * self.send_s(nbytes / ranks)


def load_links(path: Path = LINKS_PATH) -> dict[str, Link]:
    data = load_yaml(path)
    if set(data) != {"links"} or not isinstance(data["links"], dict):
        raise ConfigError(f"{path}: expected one top-level key 'links' (a mapping)")
    return {key: from_dict(Link, {"key": key, **fields}, f"{path}: links.{key}")
            for key, fields in data["links"].items()}


def resolve_link(key: str) -> Link:
    links = load_links()
    if key not in links:
        raise ConfigError(f"unknown link {key!r}; configs/links.yaml has {', '.join(links)}")
    return links[key]


@dataclasses.dataclass(frozen=True)
class Cluster:
    ranks: int
    link: Link
    parallel: str = "tensor"

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.parallel not in PARALLEL:
            raise ValueError(f"cluster: {self.ranks} ranks, parallel {self.parallel!r} "
                             f"(one of {', '.join(PARALLEL)})")

    def kv_share(self, spec: ModelSpec) -> float:
        """The fraction of a sequence's KV one rank holds (and reads)."""
        if self.parallel == "tensor" and "mla" in spec.families:
            return 1.0  # the latent cache is shared by all heads: every rank keeps all of it
        return 1.0 / self.ranks

    def weight_bytes_per_rank(self, spec: ModelSpec, dtype: str, quantize_bits: int | None) -> int:
        total = spec.weight_bytes(dtype, quantize_bits)
        if self.parallel == "pipeline":
            return -(-total // self.ranks)
        whole = replicated_bytes(spec, dtype, quantize_bits)
        return whole + -(-(total - whole) // self.ranks)

    def comm_s(self, spec: ModelSpec, rows: int, act_bytes: int) -> float:
        """One forward pass over `rows` tokens: the all-reduces (tensor) or the sends between
        stages (pipeline) of rows x hidden activations."""
        if self.ranks <= 1 or rows <= 0:
            return 0.0
        message = rows * spec.hidden_size * act_bytes
        if self.parallel == "pipeline":
            return (self.ranks - 1) * self.link.send_s(message)
        return spec.num_layers * ALL_REDUCES_PER_LAYER * self.link.all_reduce_s(message, self.ranks)


def replicated_bytes(spec: ModelSpec, dtype: str, quantize_bits: int | None) -> int:
    """Embeddings and lm head, which mlx-lm's shard() leaves whole on every rank."""
    per_weight = quantize_bits / 8 + 4 / 64 if quantize_bits else dtype_bytes(dtype)
    tables = 1 if spec.tied_embeddings else 2
    return int(tables * spec.vocab_size * spec.hidden_size * per_weight)

"""What traffic to send: a frozen WorkloadSpec (arrival process, token lengths, limits) and the
strict loaders for configs/workloads/*.yaml."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml
from batchsim.workloads.chat import ChatSpec, load_prompts
from batchsim.workloads.lengths import LengthSpec, parse_length
from batchsim.workloads.prefixes import SharingSpec
from batchsim.workloads.traces import TraceFormat, resolve_trace_path

WORKLOAD_DIR = CONFIG_DIR / "workloads"

MAX_PROMPTS = 10**7  # ~2 GB of request specs before the run starts; a simulated 23 days at 5 req/s
Arrival = Literal["poisson", "gamma", "constant", "ramp", "closed", "trace"]
OPEN_LOOP: tuple[str, ...] = ("poisson", "gamma", "constant", "ramp", "trace")

# Settings that mean something for some arrival processes only; setting one elsewhere is an error
# (a typo'd arrival would otherwise silently ignore it).
_ONLY_FOR: dict[str, tuple[str, ...]] = {
    "burstiness": ("gamma", "ramp"),
    "ramp_end_rate": ("ramp",),
    "concurrency": ("closed",),
    "think_time_s": ("closed",),
    "max_concurrency": OPEN_LOOP,
    "trace": ("trace",),
    "sharing": ("poisson", "gamma", "constant", "ramp", "closed"),  # a trace's: its hash_ids
}


def _require(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: must be {rule}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    """Replay a request trace: arrival times and token lengths come from its rows."""

    path: str  # absolute, or relative to configs/traces/ (e.g. "azure_conv_2023_slice.csv")
    format: TraceFormat = "auto"  # auto: .csv azure, .jsonl mooncake
    time_scale: float = 1.0  # arrival_s = (t - t0) * time_scale; 0.1 replays ten times faster
    input_scale: float = 1.0  # lengths are multiplied, rounded, kept >= 1, then capped
    output_scale: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None
    start: int = 0  # first row used

    def __post_init__(self) -> None:
        _require(bool(self.path), "trace.path", "a trace file", self.path)
        scale = self.time_scale
        _require(0 <= scale < math.inf, "trace.time_scale", ">= 0 and finite", scale)
        for key in ("input_scale", "output_scale"):
            value = getattr(self, key)
            _require(0 < value < math.inf, f"trace.{key}", "> 0 and finite", value)
        for key in ("max_input_len", "max_output_len"):
            value = getattr(self, key)
            _require(value is None or value >= 1, f"trace.{key}", ">= 1", value)
        _require(self.start >= 0, "trace.start", ">= 0", self.start)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """One run's traffic. Open loop (every arrival but 'closed'): requests arrive on a schedule
    whatever the server does. Closed loop: `concurrency` users each send, wait, think, repeat."""

    name: str = "workload"
    num_prompts: int = 64
    arrival: Arrival = "poisson"
    request_rate: float = 1.0  # req/s; inf = all at once
    burstiness: float = 1.0  # gamma shape (vLLM's): 1.0 = Poisson; < 1 burstier; inf = constant
    ramp_end_rate: float | None = None  # 'ramp': rate rises linearly from request_rate to this
    concurrency: int | None = None  # 'closed': this many requests always in flight
    think_time_s: float = 0.0  # 'closed': pause between a completion and that user's next request
    max_concurrency: int | None = None  # open loop: cap on requests in flight (vLLM's)
    max_request_rate: float | None = None  # cap on the issue rate (req/s), any arrival
    input_len: LengthSpec = LengthSpec("uniform", min=64, max=256)
    output_len: LengthSpec = LengthSpec("uniform", min=32, max=128)
    trace: TraceSpec | None = None  # required iff arrival == 'trace'; lengths then come from it
    # real-text chat prompts; prompt lengths and EOS then from the model
    chat: ChatSpec | None = None
    # shared system prompt, chat sessions (workloads/prefixes.py)
    sharing: SharingSpec | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(self.name), "name", "a non-empty string",
                 self.name)
        _require(1 <= self.num_prompts <= MAX_PROMPTS, "num_prompts", f">= 1 and <= {MAX_PROMPTS}",
                 self.num_prompts)
        _require(self.request_rate > 0, "request_rate", "> 0 (inf: all at once)", self.request_rate)
        _require(self.burstiness > 0, "burstiness", "> 0 (1.0 = Poisson)", self.burstiness)
        _require(self.seed >= 0, "seed", ">= 0", self.seed)
        think_s = self.think_time_s
        _require(0 <= think_s and math.isfinite(2 * think_s * self.num_prompts), "think_time_s",
                 ">= 0 with 2 x think_time_s x num_prompts finite (later arrivals would fall "
                 "past a float's range)", think_s)
        if self.max_concurrency is not None:
            _require(self.max_concurrency >= 1, "max_concurrency", ">= 1", self.max_concurrency)
        if self.max_request_rate is not None:
            _require(0 < self.max_request_rate < math.inf, "max_request_rate", "> 0 and finite",
                     self.max_request_rate)
        self._check_arrival()

    def _check_arrival(self) -> None:
        if self.arrival == "ramp":
            _require(self.request_rate < math.inf, "request_rate", "finite for arrival 'ramp'",
                     self.request_rate)
            end = self.ramp_end_rate
            _require(end is not None and 0 < end < math.inf, "ramp_end_rate",
                     "> 0 and finite for arrival 'ramp'", end)
        if self.arrival == "closed":
            _require(self.concurrency is not None and self.concurrency >= 1, "concurrency",
                     ">= 1 for arrival 'closed'", self.concurrency)
        if self.arrival == "trace":
            _require(isinstance(self.trace, TraceSpec), "trace", "set for arrival 'trace'",
                     self.trace)
        if self.sharing is not None and self.chat is not None:
            raise ConfigError("sharing: not with chat (a chat workload's prompts are real text)")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, arrivals in _ONLY_FOR.items():
            if getattr(self, key) != defaults[key] and self.arrival not in arrivals:
                raise ConfigError(
                    f"{key}: applies only to arrival {' / '.join(map(repr, arrivals))}; "
                    f"this workload's arrival is {self.arrival!r}"
                )

    @property
    def closed_loop(self) -> bool:
        return self.arrival == "closed"


def _with_context(exc: ConfigError, where: str) -> ConfigError:
    msg = str(exc)
    return exc if msg.startswith(where) else ConfigError(f"{where}: {msg}")


def _prepare(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Accept the CLI shorthand for lengths (`uniform:32:256`, `128`), and build nested sections
    once first so that their errors name the file and the section."""
    data = dict(data)
    sections = (("input_len", LengthSpec), ("output_len", LengthSpec), ("trace", TraceSpec),
                ("chat", ChatSpec), ("sharing", SharingSpec))
    for key, cls in sections:
        value = data.get(key)
        where = f"{source}: {key}"
        try:
            if cls is LengthSpec and isinstance(value, (str, int)) and not isinstance(value, bool):
                data[key] = dataclasses.asdict(parse_length(str(value)))
            elif isinstance(value, dict):
                from_dict(cls, value, where)
        except ConfigError as exc:
            raise _with_context(exc, where) from None
    return data


def workload_from_dict(data: dict[str, Any], source: str) -> WorkloadSpec:
    """A workload from a mapping (a YAML file or a section of one); errors name `source`."""
    data = _prepare(data, source)
    try:
        spec = from_dict(WorkloadSpec, data, source)
        if spec.trace is not None:
            resolve_trace_path(spec.trace.path)  # a missing trace fails here, naming the source
        if spec.chat is not None:
            load_prompts(spec.chat.prompts)  # so does a missing or malformed prompts file
    except ConfigError as exc:
        raise _with_context(exc, source) from None
    return spec


def load_workload(path: str | Path, data: dict[str, Any] | None = None,
                  where: str | None = None) -> WorkloadSpec:
    """Load one workload YAML (or `data`, read from it already: a pipe reads once); the name
    defaults to the file's stem. Unknown keys, wrong types and impossible values are ConfigErrors
    naming `where` (default: the file) and the key."""
    path = Path(path)
    data = load_yaml(path) if data is None else data
    return workload_from_dict({"name": path.stem, **data}, where or str(path))


def builtin_workload_names() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml"))


def builtin_workload(name: str) -> WorkloadSpec:
    names = builtin_workload_names()
    if name not in names:
        raise ConfigError(f"workload {name!r}: no such built-in; available: {', '.join(names)}")
    return load_workload(WORKLOAD_DIR / f"{name}.yaml")


def resolve_workload(name_or_path: str | Path) -> WorkloadSpec:
    """A built-in name (`bursty`) or a YAML path (`my.yaml`, `dir/w.yaml`)."""
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or "/" in text or Path(text).is_file():
        return load_workload(text)
    return builtin_workload(text)


def with_overrides(spec: WorkloadSpec, **changes: Any) -> WorkloadSpec:
    """dataclasses.replace ignoring None values, re-validated. Lengths may be given in the CLI form
    (`uniform:32:256`). Switching `arrival` resets the old process's own settings to their defaults
    (e.g. closed -> poisson drops `concurrency`) unless they are given too."""
    changes = {k: v for k, v in changes.items() if v is not None}
    fields = {f.name: f for f in dataclasses.fields(WorkloadSpec)}
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        allowed = ", ".join(fields)
        raise ConfigError(f"workload override {unknown[0]!r}: unknown; allowed: {allowed}")
    for key in ("input_len", "output_len"):
        if isinstance(changes.get(key), (str, int)):
            changes[key] = parse_length(str(changes[key]))
    new_arrival = changes.get("arrival", spec.arrival)
    if new_arrival != spec.arrival:
        for key, arrivals in _ONLY_FOR.items():
            if key not in changes and new_arrival not in arrivals:
                changes[key] = fields[key].default
    try:
        return dataclasses.replace(spec, **changes)
    except TypeError as exc:  # e.g. a string where a number belongs
        raise ConfigError(f"workload override: {exc}") from None

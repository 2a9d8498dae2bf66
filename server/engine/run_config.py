"""A run's configuration: model, executor, scheduler limits, memory budget and workload. Loaded from
YAML strictly (unknown keys are errors naming the file), overridden by CLI flags, frozen after."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from batchsim.configs import ConfigError, from_dict, load_yaml
from batchsim.scheduler.config import KV_LAYOUTS, KVLayout, SchedulerSettings
from batchsim.server.models.spec import FLOAT_DTYPES, KV_BITS, QUANT_BITS
from batchsim.server.perf.spec_acceptance import checked, checked_share, curve_points
from batchsim.workloads.spec import (
    WorkloadSpec,
    builtin_workload,
    load_workload,
    resolve_workload,
    with_overrides,
)

ExecutorName = Literal["mlx", "sim", "fake"]
SpecMethod = Literal["none", "ngram", "draft"]
SPEC_METHODS: tuple[str, ...] = ("none", "ngram", "draft")
# auto: float32 on the CPU backend, float16 on a GPU.
DTYPES: tuple[str, ...] = ("auto", *FLOAT_DTYPES)


MAX_MEMORY_GB = 1 << 20  # 1 PiB: a larger budget is a typo (and overflows byte counts)

@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str = "smollm2-135m-instruct"  # zoo name (default: real weights), model dir, or hub id
    dtype: str = "auto"  # one of DTYPES
    quantize: int | None = None  # QUANT_BITS: 4 or 8 (zoo models)
    kv_bits: int | None = None  # KV_BITS: K/V held as mlx-lm's QuantizedKVCache (full layers)
    # The decode pool's full-attention and MLA layers: padded rows, or paged blocks.
    kv_layout: KVLayout = "padded"
    executor: ExecutorName = "mlx"
    device_profile: str | None = None  # simulator: profile name in configs/devices or a YAML path
    engine: str = "batchsim"  # serving engine the simulator prices (configs/engines); recorded
    memory_gb: float | None = None  # budget for weights + KV in GiB; default: the device's
    ignore_eos: bool = True  # generate exactly each request's output length
    scheduler: SchedulerSettings = SchedulerSettings()
    workload: WorkloadSpec = dataclasses.field(default_factory=lambda: builtin_workload("default"))
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
    goodput: dict[str, float] | None = None  # SLOs in ms: ttft, tpot, e2el
    target: str | None = None  # an OpenAI-compatible endpoint to load instead of running in-process
    # Speculative decoding (server/executors/speculative.py); K is scheduler.spec_tokens.
    spec_method: SpecMethod = "none"
    draft_model: str | None = None  # spec_method draft: zoo name or model directory
    # executor sim: per-position acceptance rates its verify steps draw from, and how they fall
    # with the batch (server/perf/spec_acceptance.py).
    spec_acceptance: tuple[float, ...] = ()
    spec_acceptance_curve: str = "flat"
    spec_draft_share: float = 1.0  # executor sim: the chance a row drafts in a step

    def __post_init__(self) -> None:
        if self.quantize not in (None, *QUANT_BITS):
            allowed = ", ".join(map(str, QUANT_BITS))
            raise ConfigError(f"quantize: {self.quantize} is not allowed; allowed: {allowed}")
        if self.kv_bits not in (None, *KV_BITS):
            allowed = ", ".join(map(str, KV_BITS))
            raise ConfigError(f"kv_bits: {self.kv_bits} is not allowed; allowed: {allowed}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout: {self.kv_layout!r} is not allowed; allowed: "
                              f"{', '.join(KV_LAYOUTS)}")
        if self.kv_layout == "paged" and self.kv_bits is not None and self.executor == "mlx":
            raise ConfigError("kv_layout paged holds unquantized K/V: drop kv_bits, or use "
                              "kv_layout padded")
        if self.memory_gb is not None and not 0 < self.memory_gb <= MAX_MEMORY_GB:
            raise ConfigError(f"memory_gb must be > 0 and finite, at most {MAX_MEMORY_GB} GiB, "
                              f"got {self.memory_gb}")
        if not self.percentiles or not all(0 <= q <= 100 for q in self.percentiles):  # nan too
            raise ConfigError("percentiles must be numbers in 0..100, got "
                              f"{list(self.percentiles)}")
        _check_spec(self)
        _check_target(self.target)
        _check_nothing_local_with_a_target(self)
        from batchsim.server.perf.engines import DEFAULT_ENGINE, load_engine

        load_engine(self.engine)  # an unknown engine: a one-line error listing the known ones
        if self.engine != DEFAULT_ENGINE and self.executor != "sim" and self.target is None:
            raise ConfigError(f"engine {self.engine!r} is priced by the simulator: add --executor "
                              "sim (a real run measures batchsim's own engine; --target URL "
                              "measures another server)")


# What only the in-process engine reads: with --target the server under load decides them, and
# `run --target URL --spec-method draft --kv-bits 4` measured the server as it was, saying nothing.
IN_PROCESS_ONLY = ("executor", "device_profile", "kv_bits", "kv_layout", "memory_gb",
                   "spec_method", "draft_model", "spec_acceptance", "spec_acceptance_curve",
                   "spec_draft_share")


def _check_nothing_local_with_a_target(cfg: RunConfig) -> None:
    if cfg.target is None:
        return
    changed = [f.name for f in dataclasses.fields(RunConfig)
               if f.name in IN_PROCESS_ONLY and getattr(cfg, f.name) != f.default]
    changed += [f.name for f in dataclasses.fields(SchedulerSettings)
                if getattr(cfg.scheduler, f.name) != f.default]
    if changed:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in changed)
        raise ConfigError(f"--target loads a server, which decides {flags} itself: drop them "
                          "from the run (a `batchsim serve` takes its engine's on its own line)")


def _check_target(target: str | None) -> None:
    """An http(s) URL with a host (a malformed one failed every request as 'no response')."""
    if target is None:
        return
    try:
        parts = urlsplit(target)
        host, _port = parts.hostname, parts.port  # a bad port or IPv6 literal: ValueError
    except ValueError as exc:
        raise ConfigError(f"target {target!r}: not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ConfigError(f"target {target!r}: expected an http:// or https:// URL with a host, "
                          "e.g. http://127.0.0.1:8000/v1")
    key = os.environ.get("OPENAI_API_KEY", "")  # the client's bearer token (workloads/client/load)
    if any(ord(c) < 32 or ord(c) == 127 for c in key):  # aiohttp: a header-injection traceback
        raise ConfigError("OPENAI_API_KEY holds a control character (a line break copied with "
                          "it?): it cannot be sent as a bearer token")


def _check_spec(cfg: RunConfig) -> None:
    """Speculative decoding's combinations, each refused in one line."""
    method, k = cfg.spec_method, cfg.scheduler.spec_tokens
    if method not in SPEC_METHODS:
        raise ConfigError(f"spec_method: {method!r} is not allowed; allowed: "
                          f"{', '.join(SPEC_METHODS)}")
    if method == "none":
        if cfg.spec_acceptance:
            raise ConfigError("--acceptance needs --spec-method ngram and --spec-tokens K")
        if k:
            raise ConfigError("--spec-tokens needs --spec-method ngram or draft")
        if cfg.draft_model:
            raise ConfigError("--draft-model needs --spec-method draft")
        return
    if not k:
        raise ConfigError(f"--spec-method {method} needs --spec-tokens K (K >= 1)")
    if (method == "draft") != bool(cfg.draft_model):
        raise ConfigError("--spec-method draft needs --draft-model M" if method == "draft"
                          else "--draft-model needs --spec-method draft")
    _check_spec_executor(cfg)


def _check_spec_executor(cfg: RunConfig) -> None:
    """A real run measures acceptance; a simulated one draws it from given rates."""
    method, given = cfg.spec_method, bool(cfg.spec_acceptance)
    if cfg.executor == "sim":
        if not given:
            raise ConfigError("--executor sim with --spec-method draws accepted drafts from "
                              "--acceptance A[,A2...] or --acceptance-from RUN_DIR")
        checked(cfg.spec_acceptance, "spec_acceptance")
        checked_share(cfg.spec_draft_share, "spec_draft_share")
        curve_points(cfg.spec_acceptance_curve)
    elif cfg.executor != "mlx":
        raise ConfigError(f"--spec-method {method} runs on --executor mlx or sim")
    elif given or cfg.spec_acceptance_curve != "flat" or cfg.spec_draft_share != 1.0:
        raise ConfigError("--acceptance, --acceptance-from and --acceptance-curve are for "
                          "--executor sim (a real run measures acceptance)")


RUN_DIR_SECTIONS = {"config", "workload", "resolved", "env"}  # run_dir.write_config's, old too


def _run_dir_config(data: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """A run directory's config.yaml (`resolved` and `env` only once its model loaded): its
    `config:` section. Directories written before 2026-12 also hold the workload that ran as a
    top-level `workload:` (`config: workload:` was the session's, a sweep's base): run it only
    if both say the same, else one line naming the copy to keep (an edit of either was ignored
    silently, or refused pointing at the other)."""
    config, copy = data["config"], data.get("workload")
    if copy is not None and copy != config.get("workload"):
        raise ConfigError(f"{path}: holds two different workloads (an older layout): the "
                          "top-level `workload:` is what that run replayed; put the one to run "
                          "under `config: workload:` and delete the top-level one")
    return config


def load_run_config(path: str | Path) -> RunConfig:
    """A run config YAML (`model:`, `scheduler:`, `workload:` ...), or a bare workload YAML."""
    data = load_yaml(path)
    if isinstance(data.get("config"), dict) and set(data) <= RUN_DIR_SECTIONS:  # a run dir's own
        data = _run_dir_config(data, path)
    workload_keys = {f.name for f in dataclasses.fields(WorkloadSpec)}
    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    # A bare workload YAML: workload keys and no run keys (so its unknown keys are named as such).
    if set(data) & workload_keys and not set(data) & run_keys:
        # from the data already read: a second read of a pipe (`<(...)`) would be empty
        return RunConfig(workload=load_workload(path, data))
    data = dict(data)
    wl = data.get("workload")
    if isinstance(wl, str):
        data["workload"] = resolve_workload(wl)
    elif isinstance(wl, dict):
        data["workload"] = load_workload(path, wl, f"{path}: workload")
    return from_dict(RunConfig, data, str(path))


def with_run_overrides(cfg: RunConfig, workload: dict[str, Any], **changes: Any) -> RunConfig:
    """Apply CLI flags: None means 'not given'. `scheduler.*` keys go to the scheduler section."""
    sched = {k.split(".", 1)[1]: v for k, v in changes.items() if k.startswith("scheduler.")}
    top = {k: v for k, v in changes.items() if not k.startswith("scheduler.") and v is not None}
    sched = {k: v for k, v in sched.items() if v is not None}
    if sched:  # in the same replace: RunConfig checks its speculation against the scheduler's
        top["scheduler"] = dataclasses.replace(cfg.scheduler, **sched)
    new = dataclasses.replace(cfg, **top)
    if any(v is not None for v in workload.values()):
        new = dataclasses.replace(new, workload=with_overrides(new.workload, **workload))
    return new

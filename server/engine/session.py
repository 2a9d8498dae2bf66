"""Everything a run needs, built once from a RunConfig: the model (loaded through mlx-lm), the
executor, the memory budget, and the scheduler limits that follow from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchsim.configs import ConfigError
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.engine import memory
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.executors.base import Executor
from batchsim.server.executors.factory import build_executor, build_mlx_executor
from batchsim.server.models.loader import ModelRef, resolve
from batchsim.server.models.spec import ModelSpec, dtype_bytes
from batchsim.server.perf.spec_price import (
    draft_spec,
    draft_weights,
    priced_cache,
    weights_beside,
)
from batchsim.server.platform import env
from batchsim.server.platform.units import GIB, bytes_text

CPU_BUDGET_FRACTION = 0.75  # of RAM, when no GPU working-set limit exists (CPU backend)


@dataclasses.dataclass
class Session:
    config: RunConfig
    ref: ModelRef
    dtype: str
    executor: Executor
    weight_bytes: int
    memory_budget_bytes: int
    budget_source: str
    kv_bytes_per_token: int
    model: Any = None
    tokenizer: Any = None
    # What the KV cache holds by layer kind; None: dense, kv_bytes_per_token per token.
    cache_layout: CacheLayout | None = None
    # Draft models loaded for the real executor, shared by renewed sessions (a sweep's
    # speculative points load theirs once): factory.build_mlx_executor.
    drafts: dict = dataclasses.field(default_factory=dict)

    @property
    def spec(self) -> ModelSpec:
        return self.ref.spec

    @property
    def kv_budget_bytes(self) -> int:
        return self.memory_budget_bytes - self.weight_bytes

    def scheduler_config(self, **overrides: Any) -> SchedulerConfig:
        s = self.config.scheduler
        values = {
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_model_len": self.spec.max_context,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "prefill_step_size": self._prefill_step_size(),
            "policy": s.policy,
            "row_step": s.row_step,
            "spec_tokens": s.spec_tokens,
            "spec_policy": s.spec_policy,
            "max_lookahead_steps": self.executor.caps.max_lookahead_steps,
            "cache_layout": self.cache_layout,
            "kv_layout": self.config.kv_layout,
            "prefix_cache": s.prefix_cache,
            "reuse_prefixes": s.prefix_cache == "on" and self.prefix_cache_supported,
        }
        values.update(overrides)
        try:
            return SchedulerConfig(**values)
        except ValueError as exc:
            raise ConfigError(f"scheduler: {exc}") from None

    @property
    def prefix_cache_supported(self) -> bool:
        """Cached blocks are reused for full-attention and MLA layers at full precision only
        (docs/how-it-works.md: prefix caching)."""
        layout = self.cache_layout
        return (layout is None or layout.all_full) and self.config.kv_bits is None

    def _prefill_step_size(self) -> int:
        """The configured chunk; on real compute, short enough for its activations to fit
        memory.PREFILL_TRANSIENT_BYTES (a simulator has none: its chunks stay as configured)."""
        configured = self.config.scheduler.prefill_step_size
        if not self.executor.caps.real_compute:
            return configured
        return memory.prefill_step_cap(self.spec, dtype_bytes(self.dtype), configured,
                                       scores=env.backend() == "cpu")

    def limit_mlx_cache(self) -> None:
        """MLX's buffer cache follows this session's KV budget (memory.mlx_cache_limit_bytes)."""
        if self.executor.caps.real_compute:
            import mlx.core as mx

            mx.set_cache_limit(memory.mlx_cache_limit_bytes(self.kv_budget_bytes))

    def new_scheduler(self, **overrides: Any) -> Scheduler:
        return Scheduler(self.scheduler_config(**overrides))

    def renewed(self, cfg: RunConfig, memory_budget_bytes: int, budget_source: str) -> Session:
        """The same loaded model under `cfg` with a new executor (request ids start again; the
        real executor shares the model)."""
        executor = build_executor(cfg, self.ref, self.model, self.drafts)
        if executor.caps.real_compute:  # the loaded target's, and cfg's draft model as loaded
            target = self.weight_bytes - _draft_weights(self.config, self.ref, self.executor)
            weights = target + _draft_weights(cfg, self.ref, executor)
            layout = _layout(executor)
        else:  # as open_session prices them
            weights, layout = _priced(cfg, self.ref)
        new = dataclasses.replace(self, config=cfg, executor=executor, weight_bytes=weights,
                                  cache_layout=layout, memory_budget_bytes=memory_budget_bytes,
                                  budget_source=budget_source)
        _check_fits(new)
        return new

    def with_config(self, cfg: RunConfig) -> Session:
        """The same loaded model under other scheduler limits, budget or workload."""
        # What built the executor.
        keep = ("model", "dtype", "quantize", "kv_bits", "kv_layout", "executor", "device_profile",
                "engine")
        if any(getattr(cfg, k) != getattr(self.config, k) for k in keep):
            raise ValueError("with_config keeps the model and executor; open a new session instead")
        budget, source = memory_budget(cfg.memory_gb)
        new = dataclasses.replace(self, config=cfg, memory_budget_bytes=budget,
                                  budget_source=source)
        _check_fits(new)
        new.limit_mlx_cache()
        return new

    def environment(self) -> dict[str, Any]:
        return env.environment(
            model=self.ref.name, dtype=self.dtype, quantize_bits=self.ref.quantize_bits,
            weights=self.ref.weights, executor=self.config.executor,
        )


def memory_budget(memory_gb: float | None) -> tuple[int, str]:
    """Bytes for weights + KV: --memory-gb, else MLX's recommended working set on a GPU, else a
    fraction of RAM on the CPU backend (MLX enforces no memory limit there)."""
    if memory_gb is not None:
        return int(memory_gb * GIB), f"--memory-gb {memory_gb:g}"
    if env.backend() != "cpu":
        import mlx.core as mx

        info = mx.device_info()
        limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if limit:
            return int(limit), "MLX recommended working set"
    ram = env.ram_bytes()
    return int(ram * CPU_BUDGET_FRACTION), f"{CPU_BUDGET_FRACTION:.0%} of RAM (CPU backend)"


def open_session(cfg: RunConfig, executor: Executor | None = None,
                 prepare_model: Callable[[Any], Any] | None = None) -> Session:
    """`prepare_model`: applied to the loaded model before the executor is built (a rank's shard:
    weights and KV are then counted per rank)."""
    dtype = cfg.dtype if cfg.dtype != "auto" else _auto_dtype(cfg)
    budget, source = memory_budget(cfg.memory_gb)
    if cfg.executor == "sim" and cfg.memory_gb is None:
        from batchsim.server.perf.devices import mac_budget

        budget, source = mac_budget(cfg.device_profile) or (budget, source)
    if cfg.executor == "mlx" and executor is None:
        return _open_mlx(cfg, dtype, budget, source, prepare_model)
    ref = resolve(cfg.model, dtype, cfg.quantize, build=False)
    if executor is None:
        executor = build_executor(cfg, ref)
    weights, cache = _priced(cfg, ref)
    session = Session(cfg, ref, ref.dtype, executor, weights, budget, source,
                      cache.full_token_bytes, cache_layout=cache)
    _check_fits(session)
    return session


def _priced(cfg: RunConfig, ref: ModelRef) -> tuple[int, CacheLayout]:
    """Weights and cache layout of the target and cfg's draft model as priced, not loaded
    (spec_price: weights_beside, priced_cache): what a simulated session holds."""
    draft = draft_spec(cfg, ref)
    weights = ref.spec.weight_bytes(ref.dtype, ref.quantize_bits)
    return weights + weights_beside(draft, ref), priced_cache(cfg, ref, draft)


def _param_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _draft_weights(cfg: RunConfig, ref: ModelRef, executor: Executor) -> int:
    """The draft model's weights an executor holds: the real drafter's loaded parameters, or
    what the simulator prices (spec_price.draft_weights); 0: none."""
    drafter = getattr(getattr(executor, "drafter", None), "model", None)
    return draft_weights(cfg, ref) if drafter is None else _param_bytes(drafter)


def _layout(executor: Executor) -> CacheLayout | None:
    """What the scheduler prices: the executor's pool by layer kind (the simulator's `cache`),
    None where one number per token is all of it (dense, no draft model)."""
    layout = getattr(executor, "cache", None) or executor.cache_layout
    return None if layout.is_dense else layout


def _auto_dtype(cfg: RunConfig) -> str:
    """`--dtype auto`: this machine's default for real runs; for a simulated device, what it would
    run (a Mac from the catalog: float16; a calibrated profile: the dtype it was measured in)."""
    if cfg.executor != "sim":
        return env.default_dtype()
    from batchsim.server.perf.devices import profile_dtype, resolve_profile

    return profile_dtype(resolve_profile(cfg.device_profile))


def _open_mlx(cfg: RunConfig, dtype: str, budget: int, source: str,
              prepare_model: Callable[[Any], Any] | None = None) -> Session:
    from batchsim.server.models.loader import load

    # Refuse before building or loading: a cache mlx-lm cannot quantize this way, or gigabytes
    # that cannot fit.
    early = resolve(cfg.model, dtype, cfg.quantize, build=False)
    early.spec.check_kv_bits(cfg.kv_bits)
    if cfg.spec_method != "none":
        from batchsim.server.perf.spec_price import check_layers

        check_layers(early.spec, cfg.spec_method)
    _require_moe_dtype(early)
    weight_bytes = early.spec.weight_bytes(early.dtype, early.quantize_bits)
    weight_bytes += draft_weights(cfg, early)
    if prepare_model is None and weight_bytes >= budget:  # a rank's shard is checked once loaded
        _raise_no_fit(_weights_of(cfg, early.name), weight_bytes, budget, source)
    ref = resolve(cfg.model, dtype, cfg.quantize)
    model, tokenizer = load(ref)
    if prepare_model is not None:
        model = prepare_model(model)
    drafts: dict = {}
    executor = build_mlx_executor(cfg, ref, model, drafts)
    weights = _param_bytes(model) + _draft_weights(cfg, ref, executor)
    layout = _layout(executor)
    session = Session(cfg, ref, str(executor.dtype).split(".")[-1], executor, weights, budget,
                      source, executor.kv_bytes_per_token, model, tokenizer, cache_layout=layout,
                      drafts=drafts)
    _check_fits(session)
    session.limit_mlx_cache()  # replaces the executor's fixed default
    return session


def _require_moe_dtype(ref: ModelRef) -> None:
    """MLX's CPU gathered matmul (unquantized MoE experts) is float32-only: refuse in one line."""
    if ("moe" in ref.spec.families and ref.quantize_bits is None and ref.dtype != "float32"
            and env.backend() == "cpu"):
        raise ConfigError(f"model {ref.name}: MoE experts in {ref.dtype} do not run on MLX's "
                          "CPU backend (its GatherMM is float32-only); use --dtype float32 or "
                          "--quantize")


def _check_fits(session: Session) -> None:
    if session.kv_budget_bytes <= 0:
        _raise_no_fit(_weights_of(session.config, session.ref.name), session.weight_bytes,
                      session.memory_budget_bytes, session.budget_source)


def _weights_of(cfg: RunConfig, name: str) -> str:
    """Whose weights the budget holds: the model's, and the draft model's beside it."""
    return f"{name} with draft model {cfg.draft_model}" if cfg.draft_model else name


def _raise_no_fit(name: str, weights: int, budget: int, source: str) -> None:
    raise ConfigError(
        f"model {name}: weights ({bytes_text(weights)}) do not fit the memory budget "
        f"({bytes_text(budget)}, {source}); raise --memory-gb or pick a smaller "
        "dtype/quantization"
    )

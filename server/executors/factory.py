"""The one place the config's `executor: mlx|sim|fake` is read: it picks what to build. Everything
after that asks the executor's `caps`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from batchsim.server.executors.base import Executor

if TYPE_CHECKING:
    from batchsim.server.executors.mlx_executor import MLXExecutor
    from batchsim.server.models.loader import ModelRef
    from batchsim.server.perf.stepcost import StepCost


class ExecutorConfig(Protocol):
    """What building an executor reads of a run's config (a RunConfig)."""

    @property
    def executor(self) -> str: ...  # mlx | sim | fake

    @property
    def kv_bits(self) -> int | None: ...

    @property
    def kv_layout(self) -> str: ...  # padded | paged

    @property
    def device_profile(self) -> str | None: ...  # sim: a configs/devices name or a YAML path

    @property
    def engine(self) -> str: ...  # sim: the serving engine priced

    @property
    def spec_method(self) -> str: ...  # mlx: speculative decoding (none | ngram | draft)

    @property
    def draft_model(self) -> str | None: ...  # mlx: the draft model of spec_method draft

    @property
    def spec_acceptance(self) -> tuple[float, ...]: ...  # sim: per-position acceptance rates

    @property
    def spec_acceptance_curve(self) -> str: ...  # sim: how acceptance falls with the batch

    @property
    def spec_draft_share(self) -> float: ...  # sim: the chance a row drafts in a step

    @property
    def workload(self) -> Any: ...  # sim: its seed seeds the accepted-draft draws


def build_executor(cfg: ExecutorConfig, ref: ModelRef, model: Any = None,
                   drafts: dict | None = None) -> Executor:
    """The executor `cfg.executor` names, for the model `ref`; `model`: the loaded mlx-lm
    model, which only the real executor needs (`drafts`: build_mlx_executor's)."""
    if cfg.executor == "mlx":
        if model is None:
            raise ValueError("the MLX executor needs a loaded model")
        return build_mlx_executor(cfg, ref, model, drafts)
    if cfg.executor == "fake":
        from batchsim.server.executors.fake_executor import FakeExecutor

        return FakeExecutor(vocab_size=ref.spec.vocab_size)
    if cfg.executor == "sim":
        from batchsim.server.executors.sim_executor import SimExecutor
        from batchsim.server.perf.spec_price import draft_spec, priced_cache

        cost, draft = step_cost(cfg, ref), draft_spec(cfg, ref)
        return SimExecutor(cost, cache=priced_cache(cfg, ref, draft),
                           paged=cfg.kv_layout == "paged", spec=_sim_spec(cfg, ref, cost, draft))
    raise ValueError(f"unknown executor {cfg.executor!r} (mlx, sim or fake)")


def step_cost(cfg: ExecutorConfig, ref: ModelRef) -> StepCost:
    """The cost model `--executor sim` prices `ref`'s steps with under `cfg` (its device profile,
    engine, KV bits and layout); `validate`'s shadow timer prices the real runs with it too."""
    from batchsim.server.perf.devices import resolve_profile
    from batchsim.server.perf.engines import load_engine
    from batchsim.server.perf.stepcost import StepCost

    profile = resolve_profile(cfg.device_profile, ref.quantize_bits)
    return StepCost(ref.spec, profile, ref.dtype, ref.quantize_bits, kv_bits=cfg.kv_bits,
                    engine=load_engine(cfg.engine), paged=cfg.kv_layout == "paged")


def _sim_spec(cfg: ExecutorConfig, ref: ModelRef, cost: Any, draft: Any):
    """The simulated executor's SpecDraws (None: no speculation), with the drafter it prices:
    the draft model's shapes (`draft`) on the target's step cost, or the n-gram drafter."""
    if getattr(cfg, "spec_method", "none") == "none":
        return None
    from batchsim.server.executors.sim_spec import SpecDraws
    from batchsim.server.perf import spec_price
    from batchsim.server.perf.spec_acceptance import Acceptance

    drafter = spec_price.NGRAM
    if draft is not None:
        drafter = spec_price.model_drafter(cost, draft, ref.dtype)
    return SpecDraws(Acceptance(cfg.spec_acceptance, cfg.spec_acceptance_curve,
                                cfg.spec_draft_share), cfg.workload.seed, drafter)


def build_mlx_executor(cfg: ExecutorConfig, ref: ModelRef, model: Any,
                       drafts: dict | None = None) -> MLXExecutor:
    """The real executor on a loaded mlx-lm model (what a session then reads of it: its dtype,
    cache layout and KV bytes per token); `drafts`: draft models loaded already, by what was
    loaded (filled here: a sweep's speculative points share one load)."""
    from batchsim.server.executors.mlx_executor import MLXExecutor

    return MLXExecutor(model, kv_bits=cfg.kv_bits, kv_layout=cfg.kv_layout,
                       drafter=_drafter(cfg, ref, {} if drafts is None else drafts))


def _drafter(cfg: ExecutorConfig, ref: ModelRef, drafts: dict):
    """speculative.Drafter for cfg.spec_method (None: off); the draft model is loaded here as
    the account prices it (spec_price.draft_account): in the target's dtype and weight format
    (a zoo draft quantized like it, mlx-lm's group of 64; any other refused unless stored so:
    check_draft_ref), its K/V at --kv-bits. (The session
    has refused models whose layers cannot roll back: spec_price.check_layers.)"""
    from batchsim.server.executors import speculative

    method = getattr(cfg, "spec_method", "none")
    if method == "none":
        return None
    if method == "ngram":
        return speculative.NgramDrafter()
    from batchsim.server.executors.draft_model import DraftModelDrafter
    from batchsim.server.models.loader import load, resolve
    from batchsim.server.models.tokenizer import check_shared_tokenizer
    from batchsim.server.perf.spec_price import check_draft_ref

    draft = resolve(cfg.draft_model, ref.dtype, ref.quantize_bits)
    check_draft_ref(draft, ref, cfg.kv_bits)  # its caches cut back, its weights as priced
    check_shared_tokenizer(draft.path, ref.path, draft.name, ref.name)
    key = (str(draft.path), draft.dtype, draft.quantize_bits)
    if key not in drafts:
        drafts[key] = load(draft)[0]
    return DraftModelDrafter(drafts[key], cfg.kv_bits)

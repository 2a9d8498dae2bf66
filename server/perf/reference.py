"""The published MLX measurements (configs/reference/mlx-decode.yaml) as frozen dataclasses, each
row tied to a zoo model and a catalog Mac. Pure Python: the fit is in server.perf.mac_fit."""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from decimal import ROUND_HALF_UP, Decimal
from functools import lru_cache
from pathlib import Path

from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml
from batchsim.server.models.spec import zoo_names
from batchsim.server.perf.engines import SAMPLERS
from batchsim.server.perf.macs import Catalog, Mac, load_catalog
from batchsim.server.perf.qmv import mlx_release

REFERENCE_PATH = CONFIG_DIR / "reference" / "mlx-decode.yaml"
WEIGHTS = {"q4": ("float16", 4), "q8": ("float16", 8), "float16": ("float16", None),
           "bfloat16": ("bfloat16", None)}
# Where a source publishes no prompt or output length: a short chat turn.
DEFAULT_PROMPT_TOKENS = 64
DEFAULT_GENERATED_TOKENS = 256


def check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}; allowed: {', '.join(WEIGHTS)}")


class WeightFormat:
    """What a row's `weights` (q4, q8, float16, bfloat16) means to the cost model."""

    weights: str

    @property
    def dtype(self) -> str:
        return WEIGHTS[self.weights][0]

    @property
    def quantize_bits(self) -> int | None:
        return WEIGHTS[self.weights][1]


@dataclasses.dataclass(frozen=True)
class DecodeRow(WeightFormat):
    """One published batch-1 decode measurement."""

    model: str  # zoo model with the measured checkpoint's shapes
    weights: str  # q4, q8 (mlx-lm affine, group 64), float16, bfloat16
    chip: str
    gpu_cores: int | None  # None: not published (the variants must share one bandwidth)
    memory_gb: float | None
    decode_tok_s: float
    prompt_tokens: int | None
    generated_tokens: int | None
    engine: str
    src: str
    prefill_tok_s: float | None = None  # the same run's prompt rate, where published
    note: str = ""

    def __post_init__(self) -> None:
        check_weights(self.weights)


    @property
    def width_tokens(self) -> int:
        """The mean context a decode step of this run reads: prompt plus half the output."""
        prompt = DEFAULT_PROMPT_TOKENS if self.prompt_tokens is None else self.prompt_tokens
        out = DEFAULT_GENERATED_TOKENS if self.generated_tokens is None else self.generated_tokens
        return prompt + out // 2

    @property
    def label(self) -> str:
        return f"{self.model} {self.weights} on {self.chip}"


@dataclasses.dataclass(frozen=True)
class BatchedRow:
    """A published batched-serving figure: never fitted on, only predicted beside."""

    model: str
    weights: str
    chip: str
    gpu_cores: int | None
    memory_gb: float | None
    concurrent: int
    single_tok_s: float
    total_tok_s: float
    src: str


@dataclasses.dataclass(frozen=True)
class ReferenceSet:
    sources: dict[str, str]
    rows: tuple[DecodeRow, ...]
    batched: tuple[BatchedRow, ...] = ()

    def __post_init__(self) -> None:
        cited = {r.src for r in self.rows} | {b.src for b in self.batched}
        missing = sorted(cited - set(self.sources))
        if missing:
            raise ConfigError(f"reference set: src {missing[0]!r} is not listed under sources")

    @property
    def chips(self) -> list[str]:
        return sorted({r.chip for r in self.rows})

    @property
    def models(self) -> list[str]:
        return sorted({r.model for r in self.rows})


@lru_cache(maxsize=4)
def load_reference(path: str | Path = REFERENCE_PATH) -> ReferenceSet:
    return from_dict(ReferenceSet, load_yaml(path), str(path))


def row_mac(catalog: Catalog, chip: str, gpu_cores: int | None) -> Mac:
    """The catalog Mac a row ran on. Without published GPU cores every variant of the chip must
    share one bandwidth (what batch-1 decode depends on); the first is returned."""
    variants = [m for m in catalog.chips if m.chip == chip]
    if gpu_cores is not None:
        variants = [m for m in variants if m.gpu_cores == gpu_cores]
    if not variants:
        raise ConfigError(f"reference row: no catalog Mac {chip} {gpu_cores or ''}".strip())
    if len({m.bw_gbs for m in variants}) > 1:
        raise ConfigError(f"reference row on {chip}: GPU cores not given and its variants differ "
                          f"in bandwidth ({', '.join(m.label for m in variants)})")
    return variants[0]


# -- the published set (configs/reference/published.yaml): batch 1 and batched, every engine ------
PUBLISHED_PATH = CONFIG_DIR / "reference" / "published.yaml"
MEASURES = ("per_request", "aggregate")  # one stream's tok/s, or every stream's together


@dataclasses.dataclass(frozen=True)
class PublishedRow(WeightFormat):
    """One published MLX throughput figure, with what it measures (see published.yaml's header)."""

    id: str  # unique in the file
    model: str  # zoo model with the measured checkpoint's shapes
    weights: str  # WEIGHTS
    chip: str  # a configs/macs.yaml chip
    gpu_cores: int | None  # None: not published (the chip's variants must share one bandwidth)
    memory_gb: float | None
    engine: str  # mlx-lm, mlx-lm-batch, mlx-lm-server, vllm-mlx, rapid-mlx, lm-studio, ...
    engine_version: str | None  # as published; None: not stated
    batch: int  # requests decoding together (a server's concurrency)
    prompt_tokens: int | None  # None: not published
    generated_tokens: int | None  # per request; None: not published
    tok_s: float
    measures: str  # MEASURES
    decode_only: bool  # True: the decode rate only; False: the time includes prefill / TTFT
    streamed: bool  # True: measured through an HTTP server
    src: str  # a key under `sources`
    quote: str  # the figure as the source prints it
    note: str = ""
    # True: every client sends the same prompt and the server starts each request from that prompt
    # as cached by the run before (a benchmark ladder's previous level): simulated as a first round
    # of the same prompts, then the measured round with the prefix cache holding them.
    prompt_cached: bool = False
    # Where only some of the measured requests started from the cached prompt: their share (the
    # figure is then that share of a prompt_cached run's time and the rest of a cold run's; None:
    # prompt_cached says all or none).
    cached_share: float | None = None
    # Why the model cannot predict this figure (a term it should not have, or one its simulated
    # run lacks): scored, never fitted; "" for a row it can.
    unexplained: str = ""
    # How the source's harness sampled (configs/engines SAMPLERS: batched, per_row), where it
    # differs from its engine profile's (None: the profile's).
    sampler: str | None = None
    # The harness's top-p with temperature > 0 (EngineProfile.top_p: under 1 the sampler
    # argsorts each row's vocabulary), where stated; None: the profile's.
    top_p: float | None = None
    # The MLX version the source ran, where stated ('0.32.0.dev'): its kernel choice prices the
    # row (server/perf/qmv.py); None: the newest MLX's.
    mlx_version: str | None = None
    # Where the source prints no figure equal to tok_s: the arithmetic that gives it from numbers
    # its quote prints ('4 * 256 / 5.432'), checked on load; None: the quote prints tok_s.
    derived: str | None = None
    # True: the source's scheduler admits the rows one decode step apart and its figure times
    # every decode step, so its window ramps up and down through 1..batch rows
    # (server.published.sim.stagger_steps); a decode-only row only.
    staggered: bool = False

    def __post_init__(self) -> None:
        check_weights(self.weights)
        if self.sampler not in (None, *SAMPLERS):
            raise ValueError(f"sampler {self.sampler!r}; allowed: {', '.join(SAMPLERS)}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p}: in (0, 1]")
        mlx_release(self.mlx_version or "")  # a version it cannot read fails here
        if self.measures not in MEASURES:
            raise ValueError(f"measures {self.measures!r}; allowed: {', '.join(MEASURES)}")
        if self.batch < 1 or self.tok_s <= 0:
            raise ValueError(f"batch {self.batch} and tok_s {self.tok_s} must be positive")
        if any(n is not None and n < 1 for n in (self.prompt_tokens, self.generated_tokens)):
            raise ValueError(f"prompt_tokens {self.prompt_tokens} and generated_tokens "
                             f"{self.generated_tokens}: positive where published")
        if self.staggered and not (self.decode_only and self.measures == "aggregate"
                                   and self.batch > 1):
            raise ValueError("staggered: a decode-only aggregate row of batch > 1 (rows joining "
                             "one step apart; a run with prefill simulates arrivals)")
        if self.batch == 1 and self.measures == "aggregate":
            raise ValueError("a batch-1 row measures per_request")
        if not self.quote.strip():
            raise ValueError("quote is empty")
        if (self.prompt_cached or self.cached_share is not None) and (
                self.decode_only or self.batch == 1):
            raise ValueError("prompt_cached, cached_share: a batched run with prefill only")
        if self.cached_share is not None and (self.prompt_cached
                                              or not 0 < self.cached_share < 1):
            raise ValueError(f"cached_share {self.cached_share}: between 0 and 1, without "
                             "prompt_cached")


_PLAIN = re.compile(r"(\d+(?:\.\d+)?)(\s?[kK]\b)?")  # '124.845', '1.2k'
_GROUPED = re.compile(r"\d{1,3}(?:[,\u00a0\u202f ]\d{3})+(?:\.\d+)?")  # '1,111.8', '1 234'


def quoted_numbers(quote: str) -> list[Decimal]:
    """Every number `quote` prints, as written: plain ('**27.57**' -> 27.57, '1.2k' -> 1.2E+3) and
    with thousands separators ('1,111.8', '1 234'; their digits read apart too)."""
    found = [Decimal(n) * (1000 if k else 1) for n, k in _PLAIN.findall(quote)]
    return found + [Decimal(re.sub(r"[^\d.]", "", g)) for g in _GROUPED.findall(quote)]


def _as_written(figure: float) -> Decimal:
    """The YAML's figure at the places it is written: an integer at 0, a float at its shortest
    repr's (1746 -> 1746, 124.84 -> 124.84; YAML drops trailing zeros: 9.10 reads as 9.1)."""
    return Decimal(figure) if isinstance(figure, int) else Decimal(repr(float(figure)))


def rounds_to(number: Decimal, figure: Decimal) -> bool:
    """Whether `number` rounded half-up to `figure`'s decimal places is `figure`."""
    try:
        return number.quantize(Decimal(1).scaleb(figure.as_tuple().exponent),
                               ROUND_HALF_UP) == figure
    except ArithmeticError:  # a 30-digit number at 2 places exceeds Decimal's precision
        return False


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def _derived(text: str) -> str:
    """`derived 'text'` for a message, cut to 80 characters (a 5,000-character one was echoed)."""
    return f"derived {text[:80]!r}" + ("..." if len(text) > 80 else "")


def arithmetic(text: str) -> tuple[Decimal, list[Decimal]]:
    """The value of `text` (numbers, + - * /, a leading minus and parentheses, in Decimal: exact
    to its 28 significant digits, which YAML-sized figures stay within) and its numbers; any other
    expression is a ValueError, one line."""
    numbers: list[Decimal] = []
    text = text.strip()

    def value(node: ast.AST) -> Decimal:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            numbers.append(Decimal(ast.get_source_segment(text, node) or repr(node.value)))
            return numbers[-1]
        raise ValueError(f"{_derived(text)}: only numbers, + - * /, minus and parentheses")

    try:
        return value(ast.parse(text, mode="eval").body), numbers
    except (SyntaxError, ArithmeticError, RecursionError, MemoryError):  # '1+' * 5000: too deep
        raise ValueError(f"{_derived(text)}: not arithmetic over numbers") from None


def check_quoted(quote: str, figure: float, derived: str | None) -> None:
    """A typo check (ValueError, one line): the figure is a number its quote prints, rounded
    half-up to the places the YAML writes (124.84 from '124.84086550462617', 1746 from '1746.4',
    124.85 from '124.845'); or, for a derived figure, `derived`'s arithmetic over numbers the
    quote prints gives it. It does not check which of the quote's numbers it is."""
    shown = quoted_numbers(quote)
    listed = ", ".join(dict.fromkeys(f"{n:f}" for n in shown)) or "no number"
    want = _as_written(figure)
    if not want.is_finite():
        raise ValueError(f"tok_s {figure!r}: a finite number")
    if derived is None:
        if not any(rounds_to(n, want) for n in shown):
            raise ValueError(f"tok_s {figure!r} is not a number its quote prints, rounded to the "
                             f"places given (quote has {listed}; a computed figure: derived)")
        return
    got, used = arithmetic(derived)
    missing = [f"{n:f}" for n in used if n not in shown]
    if missing:
        raise ValueError(f"{_derived(derived)}: {', '.join(missing)} not in the quote (it has "
                         f"{listed})")
    if not rounds_to(got, want):
        raise ValueError(f"{_derived(derived)} gives {got:.6g}, not tok_s {figure!r}")


@dataclasses.dataclass(frozen=True)
class PublishedSet:
    sources: dict[str, str]  # key -> 'URL (machine, versions, command)'
    rows: tuple[PublishedRow, ...]

    def by_src(self, src: str) -> list[PublishedRow]:
        return [r for r in self.rows if r.src == src]


def _check_row(row: PublishedRow, tok_s: float, sources: dict[str, str], zoo: set[str],
               catalog: Catalog, where: str) -> None:
    """Raise ConfigError (one line naming `where`) if the row cannot be priced or cited."""
    if row.src not in sources:
        raise ConfigError(f"{where}: src {row.src!r} is not listed under sources")
    if row.model not in zoo:
        raise ConfigError(f"{where}: model {row.model!r} is not in the zoo (configs/models)")
    try:
        row_mac(catalog, row.chip, row.gpu_cores)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:  # the data file's rows (a test's made rows need not)
        check_quoted(row.quote, tok_s, row.derived)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    sizes_gb = _memory_sizes_gb(catalog, row.chip, row.gpu_cores)
    if row.memory_gb is not None and row.memory_gb not in sizes_gb:
        gpu = f" {row.gpu_cores}-core GPU" if row.gpu_cores else ""
        raise ConfigError(f"{where}: {row.memory_gb:g} GB was not sold with {row.chip}{gpu} "
                          f"(configs/macs.yaml: {', '.join(str(gb) for gb in sorted(sizes_gb))} "
                          "GB; or add the size there with its source)")


def _memory_sizes_gb(catalog: Catalog, chip: str, gpu_cores: int | None) -> set[int]:
    """The memory sizes the catalog lists for a chip (its GPU-core variant where published)."""
    return {gb for m in catalog.chips if m.chip == chip and gpu_cores in (None, m.gpu_cores)
            for gb in m.mem_gb}


@lru_cache(maxsize=4)
def load_published(path: str | Path = PUBLISHED_PATH) -> PublishedSet:
    """Every row validated: allowed weights and measures, a listed source with a URL, a zoo model, a
    catalog Mac; ids unique. A bad row fails in one line naming its id."""
    data = load_yaml(path)
    if set(data) != {"sources", "rows"}:
        raise ConfigError(f"{path}: expected the keys 'sources' and 'rows', got {sorted(data)}")
    sources = from_dict(PublishedSet, {"sources": data["sources"], "rows": []}, str(path)).sources
    for key, text in sources.items():
        if "https://" not in text and "http://" not in text:
            raise ConfigError(f"{path}: source {key!r} has no URL")
    if not isinstance(data["rows"], list):
        raise ConfigError(f"{path}: rows must be a list")
    zoo, catalog, rows, seen = set(zoo_names()), load_catalog(), [], set()
    for i, raw in enumerate(data["rows"]):
        rid = raw.get("id", f"#{i}") if isinstance(raw, dict) else f"#{i}"
        where = f"{path}: row {rid!r}"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
        if rid in seen:
            raise ConfigError(f"{where}: id used twice")
        row = from_dict(PublishedRow, raw, where)
        _check_row(row, raw["tok_s"], sources, zoo, catalog, where)
        rows.append(row)
        seen.add(rid)
    return PublishedSet(sources, tuple(rows))

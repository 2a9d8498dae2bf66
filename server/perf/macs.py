"""The Apple silicon catalog (configs/macs.yaml) as frozen dataclasses, the Metal working-set
arithmetic (how much unified memory the GPU may wire, by default and after raising
`iogpu.wired_limit_mb`), and a roofline `DeviceProfile` per Mac for the cost model. Pure Python: no
MLX."""

from __future__ import annotations

import dataclasses
import statistics
from functools import lru_cache
from pathlib import Path
from typing import Any

from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml
from batchsim.server.perf.profile import DeviceProfile
from batchsim.server.perf.qmv import gpu_family, has_neural_accelerators

CATALOG_PATH = CONFIG_DIR / "macs.yaml"
GIB = 1 << 30  # Apple sells RAM in binary gigabytes: a "16 GB" Mac has 16 GiB
# An M5 GPU core's Neural Accelerators multiply FP16 matrices at ~1024 FLOP a cycle, 4x its 128 FP32
# lanes' 256 (configs/macs.yaml tzakharko_na: A19 matrix FP16 7500 vs SIMD FP32 1880 GFLOPS,
# iso-clock, a peak without data movement); Apple's "over 4x the peak GPU compute for AI compared
# to M4" (apple_m5) is consistent with it as a floor. The prior for an M5's FP16 peak.
NAX_FP16_PER_FP32 = 4.0


@dataclasses.dataclass(frozen=True)
class Mac:
    """One chip / GPU-core variant and the memory sizes it was sold with."""

    chip: str
    gpu_cores: int
    mem_gb: tuple[int, ...]
    bw_gbs: float  # Apple-quoted peak bandwidth, GB/s
    fp32_tflops: float | None  # None: not public (compute bound unknown)
    fp16_tflops: float | None
    src: tuple[str, ...]
    clock_ghz: float | None = None
    estimate: bool = False  # peaks derived from third-party clocks
    unverified: bool = False
    note: str = ""
    # Its CPU generation's single-core score over the reference generation's (configs/macs.yaml
    # cpu_single_core; set by the catalog).
    cpu_speed: float = 1.0

    @property
    def label(self) -> str:
        return f"{self.chip} {self.gpu_cores}c"

    @property
    def fp16_unfitted_tflops(self) -> float | None:
        """Its FP16 peak from no published row: NAX_FP16_PER_FP32 x its FP32 peak on a GPU with
        Neural Accelerators (an M5), else the FP32 peak (M1-M4 run FP16 at the FP32 rate). A fold
        without the rows an estimated fp16_tflops came from prices the chip with it
        (server.published.cv.fold_catalog)."""
        if self.fp32_tflops is None:
            return None
        nax = has_neural_accelerators(gpu_family(self.chip))
        return self.fp32_tflops * (NAX_FP16_PER_FP32 if nax else 1.0)

    @property
    def compute_known(self) -> bool:
        return self.fp16_tflops is not None and self.fp32_tflops is not None

    def profile(self, bandwidth_efficiency: float, compute_efficiency: float) -> DeviceProfile:
        """Roofline profile. A Mac without FLOP/s figures has none: an unknown compute bound is
        never taken as unlimited."""
        if self.fp16_tflops is None or self.fp32_tflops is None:
            raise ConfigError(f"{self.label} has no FLOP/s figure in configs/macs.yaml: its step "
                              "time cannot be predicted")
        fp16, fp32 = self.fp16_tflops, self.fp32_tflops
        # No bf16 column: M1-M4 GPUs run bf16 no faster than fp16, so fp16 is a ceiling.
        return DeviceProfile(
            name=self.label, bandwidth_gbs=self.bw_gbs,
            peak_tflops={"float16": fp16, "bfloat16": fp16, "float32": fp32},
            bandwidth_efficiency=bandwidth_efficiency, compute_efficiency=compute_efficiency,
            source=f"configs/macs.yaml: {', '.join(self.src)}",
        )


@dataclasses.dataclass(frozen=True)
class Unconfirmed:
    chip: str
    status: str


@dataclasses.dataclass(frozen=True)
class FractionRule:
    max_ram_gb: float | None  # None: any size
    fraction: float


@dataclasses.dataclass(frozen=True)
class MetalWorkingSet:
    what: str
    default_rule_of_thumb: str
    default_fraction: tuple[FractionRule, ...]
    os_reserve_gb: float
    os_reserve_src: tuple[str, ...]
    measured_points: tuple[dict[str, Any], ...]
    iogpu_wired_limit_mb: dict[str, str]

    def __post_init__(self) -> None:
        if not self.default_fraction or self.default_fraction[-1].max_ram_gb is not None:
            raise ConfigError("metal_working_set.default_fraction must end with max_ram_gb: null")

    def fraction(self, ram_gb: float) -> float:
        for rule in self.default_fraction:
            if rule.max_ram_gb is None or ram_gb <= rule.max_ram_gb:
                return rule.fraction
        raise AssertionError("unreachable: the last rule covers any size")


@dataclasses.dataclass(frozen=True)
class ReferenceRow:
    chip: str
    gpu_cores: int
    bw_gbs: float
    pp_f16: float | None  # prompt tok/s at batch 512, F16
    tg: dict[str, float]  # decode tok/s at batch 1, per weight format


@dataclasses.dataclass(frozen=True)
class DecodeReference:
    src: tuple[str, ...]
    model: str
    params: int
    file_gib: dict[str, float]
    rows: tuple[ReferenceRow, ...]


@dataclasses.dataclass(frozen=True)
class CpuScores:
    """Single-core scores by chip generation ('M1'..'M5') and the one the fitted costs describe."""

    scores: dict[str, float]
    reference: str
    src: tuple[str, ...]

    def speed(self, chip: str) -> float:
        """A chip's CPU single-core score over the reference generation's."""
        generation = chip.split()[0]
        if generation not in self.scores or self.reference not in self.scores:
            raise ConfigError(f"cpu_single_core has no score for {generation} or the reference "
                              f"{self.reference}")
        return self.scores[generation] / self.scores[self.reference]


@dataclasses.dataclass(frozen=True)
class Catalog:
    sources: dict[str, str]
    chips: tuple[Mac, ...]
    unconfirmed: tuple[Unconfirmed, ...]
    metal_working_set: MetalWorkingSet
    decode_reference: DecodeReference
    cpu_single_core: CpuScores

    def __post_init__(self) -> None:
        cited = ({s for m in self.chips for s in m.src} | set(self.decode_reference.src)
                 | set(self.cpu_single_core.src))
        missing = sorted(cited - set(self.sources))
        if missing:
            raise ConfigError(f"macs catalog: src {missing[0]!r} is not listed under sources")
        cpu = self.cpu_single_core
        object.__setattr__(self, "chips", tuple(dataclasses.replace(m, cpu_speed=cpu.speed(m.chip))
                                                for m in self.chips))

    @property
    def chip_names(self) -> list[str]:
        return list(dict.fromkeys(m.chip for m in self.chips))

    def select(self, name: str | None) -> list[Mac]:
        """All Macs; or those whose chip is `name` exactly; else whose label contains it (any
        case)."""
        if not name:
            return list(self.chips)
        q = name.strip().lower()
        exact = [m for m in self.chips if m.chip.lower() == q]
        found = exact or [m for m in self.chips if q in m.label.lower()]
        if not found:
            raise ConfigError(f"unknown Mac {name!r}; chips: {', '.join(self.chip_names)} "
                              "(a chip name, a substring, or a label like 'M2 Ultra 76c')")
        return found


    def variant(self, name: str) -> tuple[Mac, str]:
        """The one Mac a profile name means, and a note when the name had a choice. A chip name
        with several GPU variants ("M2 Ultra": 60c, 76c) means its base variant, listed first (the
        conservative choice for sizing); a name matching several chips is an error."""
        found = self.select(name)
        chips = list(dict.fromkeys(m.chip for m in found))
        if len(chips) > 1:
            raise ConfigError(f"Mac {name!r} is ambiguous: {', '.join(m.label for m in found)}; "
                              "name one chip or a label like 'M2 Ultra 76c'")
        mac = found[0]
        note = "" if len(found) == 1 else (
            f"{name!r} has {len(found)} GPU variants ({', '.join(m.label for m in found)}): "
            f"the base one, {mac.label}, is used; name a label to choose")
        return mac, note


@lru_cache(maxsize=4)
def load_catalog(path: str | Path = CATALOG_PATH) -> Catalog:
    return from_dict(Catalog, load_yaml(path), str(path))


def default_working_set_bytes(ram_gb: float, ws: MetalWorkingSet) -> int:
    """macOS's default recommendedMaxWorkingSetSize under the catalog's rule."""
    return int(ram_gb * GIB * ws.fraction(ram_gb))


def raised_working_set_bytes(
    ram_gb: float, ws: MetalWorkingSet, os_reserve_gb: float | None = None
) -> int:
    """After `sudo sysctl iogpu.wired_limit_mb=(RAM - reserve)`; never below the default."""
    reserve = ws.os_reserve_gb if os_reserve_gb is None else os_reserve_gb
    return max(default_working_set_bytes(ram_gb, ws), int((ram_gb - reserve) * GIB))


def weight_format(quantize_bits: int | None) -> str:
    """The decode_reference column that streams weights like this quantization (None: float)."""
    return {None: "F16", 8: "Q8_0", 4: "Q4_0"}[quantize_bits]


def bandwidth_fractions(ref: DecodeReference, fmt: str) -> list[tuple[str, float]]:
    """Per reference chip: measured decode tok/s x bytes per token / peak bandwidth."""
    nbytes = ref.file_gib[fmt] * GIB
    return [(f"{r.chip} {r.gpu_cores}c", r.tg[fmt] * nbytes / (r.bw_gbs * 1e9))
            for r in ref.rows if fmt in r.tg]


def compute_fractions(ref: DecodeReference, chips: tuple[Mac, ...]) -> list[tuple[str, float]]:
    """Per reference chip with a catalog FP16 peak: F16 prompt FLOP/s over that peak."""
    peaks = {(m.chip, m.gpu_cores): m.fp16_tflops for m in chips}
    out = []
    for r in ref.rows:
        peak = peaks.get((r.chip, r.gpu_cores))
        if r.pp_f16 and peak:
            out.append((f"{r.chip} {r.gpu_cores}c", r.pp_f16 * 2 * ref.params / (peak * 1e12)))
    return out


def _median_source(
    fractions: list[tuple[str, float]], what: str, catalog: Catalog
) -> tuple[float, str]:
    values = [f for _, f in fractions]
    return statistics.median(values), (
        f"median of {len(values)} chips ({min(values):.2f}-{max(values):.2f}) of {what}, "
        f"{catalog.decode_reference.model}, {catalog.sources['llama_cpp_4167']}"
    )


def bandwidth_efficiency(catalog: Catalog, fmt: str) -> tuple[float, str]:
    """The median llama.cpp decode fraction for a weight format, and where it comes from: the
    plain roofline's efficiency before the MLX fit (`fit-macs` prints it as "before")."""
    ref = catalog.decode_reference
    what = f"{fmt} decode tok/s x {ref.file_gib[fmt]} GiB / peak GB/s"
    return _median_source(bandwidth_fractions(ref, fmt), what, catalog)


def compute_efficiency(catalog: Catalog) -> tuple[float, str]:
    """The median llama.cpp fraction of FP16 peak in large matmuls (the pre-fit roofline's)."""
    what = "F16 prompt tok/s (batch 512) x 2 x params / FP16 peak"
    return _median_source(compute_fractions(catalog.decode_reference, catalog.chips), what, catalog)

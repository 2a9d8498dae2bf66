"""Device profiles for the simulator: calibrated YAML files (`batchsim calibrate` writes them) or a
Mac from the catalog (roofline with the catalog's achievable-efficiency fractions)."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import yaml
from batchsim.configs import CONFIG_DIR, ConfigError, load_dataclass
from batchsim.server.models.spec import DTYPE_BYTES
from batchsim.server.perf import profile_match
from batchsim.server.perf.profile import DeviceProfile
from batchsim.server.results.jsonio import yamlable

SHIPPED_DIR = CONFIG_DIR / "devices"
LOCAL_NAME = "local"  # what `batchsim calibrate` writes for this machine by default


def user_dir() -> Path:
    return Path(os.environ.get("BATCHSIM_HOME") or Path.home() / ".cache" / "batchsim") / "devices"


def save_profile(profile: DeviceProfile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(yamlable(dataclasses.asdict(profile)), sort_keys=False))
    return path


# A profile's rates, each a divisor of some cost: zero, negative or NaN priced steps that ended
# before they began (a ValueError traceback) or never ended (the run hung).
POSITIVE = ("bandwidth_gbs", "peak_tflops", "bandwidth_efficiency", "compute_efficiency",
            "expert_bandwidth_efficiency", "quantized_gemv_gbs", "quantized_gemm_gflops")


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile YAML, its numbers checked: rates positive and finite, costs and other terms
    finite and >= 0, the calibration's too (a GEMM table's negative ns priced a step that ended
    before it began, a ValueError traceback; a NaN one never ended: the run hung)."""
    profile = load_dataclass(DeviceProfile, path)
    numbers = _numbers(dataclasses.asdict(profile), "")
    for key, value in numbers:
        positive = key in POSITIVE or key.split(".")[0] in POSITIVE or key == "calibration.copy_gbs"
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            raise ConfigError(f"{path}: {key} must be finite and {'> 0' if positive else '>= 0'}, "
                              f"got {value}")
    return profile


def _numbers(data: dict, prefix: str) -> list[tuple[str, float]]:
    """Every number in a profile's (nested) mappings, with its dotted key."""
    found = []
    for key, value in data.items():
        where = f"{prefix}{key}"
        if isinstance(value, dict):
            found += _numbers(value, f"{where}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found.append((where, value))
    return found


def _candidates(name: str) -> list[Path]:
    return [Path(name), user_dir() / f"{name}.yaml", SHIPPED_DIR / f"{name}.yaml"]


def profile_names() -> list[str]:
    names = {p.stem for d in (user_dir(), SHIPPED_DIR) if d.exists() for p in d.glob("*.yaml")}
    return sorted(names)


def mac_budget(name: str | None) -> tuple[int, str] | None:
    """For a Mac profile: its largest memory option's default Metal working set."""
    if not name or any(p.suffix in (".yaml", ".yml") and p.is_file() for p in _candidates(name)):
        return None
    from batchsim.server.perf import macs

    catalog = macs.load_catalog()
    try:
        mac, _ = catalog.variant(name)
    except ConfigError:
        return None
    ram = max(mac.mem_gb)
    usable = macs.default_working_set_bytes(ram, catalog.metal_working_set)
    return usable, f"{mac.label} {ram} GB: default Metal working set"


def profile_for_this_machine() -> str:
    """The profile a simulation gets without a name: `local` (what `batchsim calibrate` writes)
    if there is one, else the calibrated profile whose CPU and BLAS are this machine's (as
    `validate` compares them); else a one-line error saying what to pass."""
    if any(p.suffix == ".yaml" and p.is_file() for p in _candidates(LOCAL_NAME)):
        return LOCAL_NAME
    here = profile_match.here()
    calibrated = {}
    for name in profile_names():
        c = resolve_profile(name).calibration
        if c is not None and c.device:
            calibrated[name] = c.device
    for name, device in calibrated.items():
        if not profile_match.differs(device, here):
            return name
    offered = "; ".join(f"{n}, calibrated on {d}" for n, d in calibrated.items()) or "none"
    raise ConfigError(
        f"no device profile given and none was calibrated on this machine ({here}): pass "
        f"--device-profile NAME: a calibrated profile ({offered}) or a Mac chip (\"M2 Max\"), "
        "or run `batchsim calibrate` to measure this machine"
    )


def resolve_profile(name: str | None, quantize_bits: int | None = None) -> DeviceProfile:
    """A YAML path, a calibrated profile name, or a Mac from the catalog ("M4 Max 40c"; a chip with
    several GPU variants, "M2 Max", means its base one: macs.Catalog.variant, said in the profile's
    source) with the GPU step fitted on published MLX measurements (server.perf.gpu_fit). None:
    the one calibrated on this machine (profile_for_this_machine)."""
    name = name or profile_for_this_machine()
    for path in _candidates(name):
        if path.suffix in (".yaml", ".yml") and path.is_file():
            return load_profile(path)
    from batchsim.server.perf import gpu_fit, macs

    catalog = macs.load_catalog()
    try:
        known = bool(catalog.select(name))
    except ConfigError:
        known = False
    if known:
        mac, note = catalog.variant(name)  # a name matching several chips: a one-line error
        profile = gpu_fit.mac_profile(mac, gpu_fit.load_fit(), quantize_bits)
        return dataclasses.replace(profile, source=f"{profile.source}{'; ' + note if note else ''}")
    hint = "run `batchsim calibrate` to measure this machine" if name == LOCAL_NAME else ""
    raise ConfigError(
        f"device profile {name!r} not found; calibrated profiles: "
        f"{', '.join(profile_names()) or 'none'}; or a Mac chip: {', '.join(catalog.chip_names)}"
        + (f"; {hint}" if hint else "")
    )


def profile_dtype(profile: DeviceProfile) -> str:
    """The dtype a device runs by default: what its calibration measured (the CPU backend's
    float32 here), else float16, as MLX does on every Mac's GPU."""
    gemm = profile.calibration.gemm if profile.calibration else {}
    measured = [f for f in gemm if f in DTYPE_BYTES]
    return measured[0] if measured else "float16"


def config_warning(cfg) -> str | None:
    """profile_match.mismatch_warning for a RunConfig that simulates (`executor: sim`); None
    otherwise or when the profile cannot be resolved (opening the session reports that)."""
    if cfg.executor != "sim":
        return None
    try:
        profile = resolve_profile(cfg.device_profile, cfg.quantize)
    except (ConfigError, ValueError):
        return None
    return profile_match.mismatch_warning(profile, cfg.device_profile)

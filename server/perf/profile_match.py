"""Whether a calibrated profile was measured on this machine. A profile's `device` names the CPU
(with its family and model where known: cloud VMs of one name span CPU generations) and the BLAS
build that ran its GEMMs; a profile from another CPU or BLAS predicts this one's steps wrongly
(85% slow on one EPYC family with a profile from the next). `run`, `sweep`, `compare` and
`validate` warn with `mismatch_warning`."""

from __future__ import annotations

import re

from batchsim.server.perf.profile import DeviceProfile
from batchsim.server.platform import env

_FAMILY = re.compile(r"\s*\(family [^)]*\)$")
UNKNOWN = ("", "unknown", "none")


def cpu_model() -> str:
    """'family 25 model 17' from /proc/cpuinfo ("" where it does not say, e.g. macOS)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        return ""
    if "cpu family" not in fields:
        return ""
    return f"family {fields['cpu family']} model {fields.get('model', '?')}"


def device_id(env_info: dict, model: str | None = None) -> str:
    """What a calibration is only valid on: 'CPU (family F model M), BLAS build'."""
    cpu = env_info.get("device_name") or env_info.get("cpu") or ""
    model = cpu_model() if model is None else model
    if cpu and model:
        cpu = f"{cpu} ({model})"
    blas = env_info.get("blas_version") or env_info.get("blas") or ""
    return ", ".join(x for x in (cpu, blas) if x)


def here() -> str:
    """This machine's device_id."""
    return device_id(env.environment())


def _parts(device: str) -> tuple[str, str, str]:
    """(CPU name, family/model or '', BLAS or '') of a device_id."""
    cpu, _, blas = device.partition(", ")
    family = _FAMILY.search(cpu)
    name = _FAMILY.sub("", cpu)
    return name, family.group(0).strip(" ()") if family else "", blas


def differs(calibrated_on: str, this: str) -> bool:
    """True when the CPU name, the CPU family/model or the BLAS build differ; a part that either
    side does not record (older profiles lack the family) is not held against the profile."""
    a, b = _parts(calibrated_on), _parts(this)
    for x, y in zip(a, b):
        if x.lower() not in UNKNOWN and y.lower() not in UNKNOWN and x != y:
            return True
    return False


def mismatch_warning(profile: DeviceProfile, name: str | None = None,
                     this: str | None = None) -> str | None:
    """One line naming both machines when `profile` was calibrated elsewhere (None: it was
    calibrated here, or it is a catalog Mac, which is not a calibration of any machine)."""
    calibrated_on = profile.calibration.device if profile.calibration else ""
    this = here() if this is None else this
    if not calibrated_on or not differs(calibrated_on, this):
        return None
    return (f"warning: profile {name or profile.name!r} was calibrated on {calibrated_on}; this "
            f"machine is {this}. Its predictions may be far off here: run `batchsim calibrate "
            "--quick` (a few minutes) for a profile of this machine.")

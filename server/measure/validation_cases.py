"""`batchsim validate`'s cases: the matrix YAML (configs/validation: a `model` and its `cases`),
and each case as a RunConfig."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from batchsim.configs import CONFIG_DIR, ConfigError, load_yaml
from batchsim.scheduler.config import SchedulerSettings
from batchsim.workloads.spec import workload_from_dict

MATRIX = CONFIG_DIR / "validation" / "matrix.yaml"


def matrix_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    shipped = MATRIX.parent / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    raise ConfigError(f"--matrix {name}: no such file, nor a matrix in {MATRIX.parent} "
                      f"({', '.join(sorted(p.stem for p in MATRIX.parent.glob('*.yaml')))})")


def load_cases(path: Path, names: str | None) -> list[dict[str, Any]]:
    cases = load_yaml(path).get("cases") or []
    if names:
        wanted = [n.strip() for n in names.split(",")]
        known = {c["name"] for c in cases}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise ConfigError(f"{path}: no case {missing[0]!r}; cases: {', '.join(sorted(known))}")
        cases = [c for c in cases if c["name"] in wanted]
    return cases


def case_config(base, case: dict[str, Any], weight_bytes: int):
    allowed = {"name", "max_num_seqs", "memory_gb", "policy", "workload"}
    unknown = set(case) - allowed
    if unknown:
        raise ConfigError(f"validation case {case.get('name')}: unknown key {min(unknown)!r}; "
                          f"allowed: {', '.join(sorted(allowed))}")
    memory = case.get("memory_gb")
    if isinstance(memory, str) and memory.startswith("weights+"):
        memory = weight_bytes / (1 << 30) + float(memory.split("+", 1)[1])
    workload = workload_from_dict({"name": case["name"], **case["workload"]},
                                  f"validation case {case['name']}: workload")
    sched = SchedulerSettings(max_num_seqs=case["max_num_seqs"],
                              policy=case.get("policy", SchedulerSettings.policy))
    return dataclasses.replace(base, scheduler=sched, memory_gb=memory, workload=workload)

"""Shared fixtures: models built once per session (seeded random weights, real architectures),
loaded through mlx-lm. BATCHSIM_TEST_HOME reuses builds across runs; otherwise a temp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from batchsim.server.platform import blas

blas.preload()  # before anything imports mlx, as the CLI does

from batchsim.server.results import record_process

from tests.backend import dtype_for
from tests.dispositions import answer_inherited_stop_signals


def pytest_configure(config: pytest.Config) -> None:
    answer_inherited_stop_signals()


@pytest.fixture(autouse=True)
def _no_rank_keep_deadline(monkeypatch) -> None:
    """A rank's _start_keeping sets record_process.keep_until_s (test_rank_keeping calls it here,
    in pytest's process): each test starts without it, or once it passed every later writer
    process would be killed at close without a wait."""
    monkeypatch.setattr(record_process, "keep_until_s", None)


@pytest.fixture(scope="session")
def batchsim_home(tmp_path_factory) -> Path:
    home = os.environ.get("BATCHSIM_TEST_HOME")
    path = Path(home) if home else tmp_path_factory.mktemp("batchsim-home")
    os.environ["BATCHSIM_HOME"] = str(path)
    return path


def _load(name: str, dtype: str, quantize: int | None = None):
    from batchsim.server.models.loader import load, resolve

    ref = resolve(name, dtype, quantize)
    model, tokenizer = load(ref)
    return ref, model, tokenizer


@pytest.fixture(scope="session")
def quantized_dtype() -> str:
    """The dtype of a test model whose matmuls or attention are quantized: float32 on the CPU
    backend, float16 where MLX's GPU quantized kernels need it (tests/backend.py)."""
    return dtype_for(quantized=True)


@pytest.fixture(scope="session")
def tiny(batchsim_home):
    return _load("tiny", "float32")


@pytest.fixture(scope="session")
def tiny_moe(batchsim_home):
    return _load("tiny-moe", "float32")  # float32: CPU GatherMM has no float16 kernel


@pytest.fixture(scope="session")
def smollm2(batchsim_home):
    return _load("smollm2-135m", "float32")


@pytest.fixture(scope="session")
def tiny_q4(batchsim_home):
    return _load("tiny", "float16", 4)

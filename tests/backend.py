"""What the executor suites' token comparisons prove on each MLX backend.

On the CPU backend a row's logits alone and in a batch differ by under CPU_BATCH_REL of the
largest |logit| (float32 BLAS GEMM against GEMV; checked: tests/test_backend_invariance.py), far
below the logit gaps these seeded tests meet, so tokens must be identical there and a differing
token is a bug. MLX's GPU backends reduce a batch of B rows in another order than one row, in
float16, so on random-weight tiny models a near-tied argmax can flip. There a request's tokens may
differ from the reference only where the reference's logits nearly tie: at the first differing
token the two candidates' logits (the reference's context, one row, mlx-lm's own caches) may
differ by at most NEAR_TIE_REL of the largest |logit|; the tokens after it follow another context
and are not compared."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

CPU_BATCH_REL = 1e-5  # measured: 9e-7 on tiny (float32, batch 8 vs 1, OpenBLAS)
# Relative logit gap counted as a tie, by the activations' dtype: about twenty float16 ulps, or a
# TF32 matmul's rounding for float32; the invariance test holds batched-vs-single logits to a
# quarter of it.
NEAR_TIE_REL = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 2e-3}


def backend() -> str:
    from batchsim.server.platform import env

    return env.backend()


def exact_tokens() -> bool:
    """Whether batched tokens must equal single-row ones exactly: the CPU backend (see above)."""
    return backend() == "cpu"


def dtype_for(quantized: bool = False) -> str:
    """The dtype a test model runs in: float32 on the CPU (BLAS; quantized matmuls have kernels
    there in every dtype), float16 elsewhere when quantized matmuls are in play (MLX's CUDA
    quantized kernels have no float32 at these shapes), float32 otherwise."""
    return "float16" if quantized and not exact_tokens() else "float32"


def _first_difference(got: list[int], want: list[int]) -> int | None:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return i if i is not None or len(got) == len(want) else min(len(got), len(want))


def _logits(model, ids: list[int], make_cache: Callable):
    import mlx.core as mx

    logits = model(mx.array(ids)[None], cache=make_cache(model))[0, -1].astype(mx.float32)
    mx.eval(logits)
    return logits


def assert_same_tokens(model, prompts: dict, got: dict, want: dict,
                       make_cache: Callable | None = None) -> None:
    """got == want (token ids by request) on the CPU backend; elsewhere each request's tokens may
    first differ only at a near-tie of `want`'s logits (module docstring)."""
    if exact_tokens() or got == want:
        assert got == want
        return
    from mlx_lm.models.cache import make_prompt_cache

    assert got.keys() == want.keys()
    for rid, ref in want.items():
        i = _first_difference(got[rid], ref)
        if i is None:
            continue
        assert i < min(len(got[rid]), len(ref)), (rid, "lengths differ", got[rid], ref)
        logits = _logits(model, list(prompts[rid]) + ref[:i], make_cache or make_prompt_cache)
        gap = abs(logits[ref[i]].item() - logits[got[rid][i]].item())
        scale = abs(logits).max().item()
        dtype = model_dtype(model)
        log(kind="near_tie", rid=rid, at=i, gap=gap, scale=scale, dtype=dtype, backend=backend())
        assert gap <= NEAR_TIE_REL[dtype] * scale, (
            f"request {rid}: token {i} is {got[rid][i]}, reference {ref[i]}: logit gap {gap:.3g} "
            f"> {NEAR_TIE_REL[dtype]:g} x {scale:.3g} (not a near-tie)")


def model_dtype(model) -> str:
    """The dtype of the model's float parameters (a quantized model's scales)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    floats = [v.dtype for _, v in tree_flatten(model.parameters())
              if v.dtype in (mx.float16, mx.bfloat16, mx.float32)]
    return str(floats[0]).rsplit(".", 1)[-1] if floats else "float32"


def log(**row) -> None:
    """Every near-tie excused and invariance reading, appended to $BATCHSIM_TEST_DIVERGENCE_LOG
    when set (scripts/gpu_check.sh)."""
    path = os.environ.get("BATCHSIM_TEST_DIVERGENCE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

"""Kernels per decode layer by architecture (server.perf.kernels): the counts, their features
checked against mlx-lm's own modules, and the catalog step's fixed cost priced by them."""

import importlib
import inspect
from collections import Counter

import pytest
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import gpu_fit, macs
from batchsim.server.perf.kernels import (
    FAMILIES,
    REFERENCE_LAYER_KERNELS,
    kernel_layers,
    layer_kernels,
)
from batchsim.server.perf.stepcost import StepCost
from mlx import nn

# One zoo model per family and its layers' kernel counts (hand-counted: kernels.py's docstring).
COUNTS = {
    "llama-3.2-1b": {17: 16}, "qwen2.5-0.5b": {20: 24}, "qwen3-0.6b": {19: 28},
    "gemma-3-1b": {28: 26}, "qwen3-30b-a3b": {27: 48}, "gpt-oss-20b": {34: 24},
    "qwen3-next-80b-a3b": {41: 36, 37: 12}, "deepseek-v3": {24: 3, 41: 58},
}


@pytest.mark.parametrize("model", sorted(COUNTS))
def test_layer_kernels_by_family(model):
    spec = zoo_spec(model)
    got = Counter(layer_kernels(spec.model_type, layer) for layer in spec.arch.layers)
    assert dict(got) == COUNTS[model]


def test_reference_layer_is_llamas_and_uncounted_families_keep_it():
    llama = zoo_spec("llama-3.1-8b")
    assert kernel_layers(llama, 4) == kernel_layers(llama, None) == llama.num_layers
    assert layer_kernels("llama", llama.arch.layers[0]) == REFERENCE_LAYER_KERNELS
    assert layer_kernels("mistral", llama.arch.layers[0]) == REFERENCE_LAYER_KERNELS


def _mlx_lm_layer(model: str, index: int):
    """mlx-lm's own decoder layer for the model's config (4 layers, weights never evaluated)."""
    spec = zoo_spec(model)
    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    args = module.ModelArgs.from_dict(dict(spec.config, num_hidden_layers=4))
    return module.Model(args).layers[index]


def test_a_float_linears_bias_is_no_kernel_of_its_own():
    """mlx's float Linear adds its bias inside addmm; a quantized one adds it after its qmm."""
    layer = zoo_spec("qwen2.5-0.5b").arch.layers[0]
    assert layer_kernels("qwen2", layer, quantized=False) == REFERENCE_LAYER_KERNELS
    assert layer_kernels("qwen2", layer, quantized=True) == REFERENCE_LAYER_KERNELS + 3
    assert "addmm" in inspect.getsource(nn.Linear.__call__)
    assert "quantized_matmul" in inspect.getsource(nn.QuantizedLinear.__call__)


def test_gated_deltas_compute_g_is_one_compiled_kernel():
    """qwen3_next's gated-delta mixer counts compute_g once: mlx-lm compiles it."""
    pytest.importorskip("mlx_lm")
    source = inspect.getsource(importlib.import_module("mlx_lm.models.gated_delta"))
    head = source[:source.index("def compute_g")].rstrip().splitlines()[-1]
    assert "mx.compile" in head


@pytest.mark.parametrize("model", sorted(set(COUNTS) - {"deepseek-v3"}))  # MLA: its own norms
def test_family_features_match_mlx_lm_modules(model):
    """Norms and biased attention projections of the last (attention) layer as mlx-lm builds it."""
    pytest.importorskip("mlx_lm")
    family = FAMILIES[zoo_spec(model).model_type]
    layer = _mlx_lm_layer(model, 3)
    modules = dict(layer.named_modules())
    norms = [m for m in modules.values() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == family.layer_norms + (2 if family.qk_norm else 0)
    biased = [n for n, m in modules.items()
              if isinstance(m, nn.Linear) and "bias" in m and n.startswith("self_attn.")]
    assert len(biased) == family.proj_biases
    adds_one = "1.0 + self.weight" in inspect.getsource(type(norms[0]).__call__)
    assert family.norm_kernels == (2 if adds_one else 1)


def test_gemma_layers_pay_their_kernels_fixed_cost():
    """A catalog Mac's fixed cost per forward: layer_overhead_s per 17 kernels, so a gemma layer
    (28 kernels) costs 28/17 of a llama layer's."""
    catalog, fit = macs.load_catalog(), gpu_fit.load_fit()
    mac = catalog.select("M2 Ultra")[0]
    profile = gpu_fit.mac_profile(mac, fit, 4)
    gemma = zoo_spec("gemma-3-1b")
    step = StepCost(gemma, profile, "float16", 4).decode_time(1, 128)
    want = 26 * 28 / 17 * profile.layer_overhead_s + profile.forward_overhead_s
    assert step.fixed_s == pytest.approx(want)

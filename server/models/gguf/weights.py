"""GGUF tensors to the Hugging Face names and layout mlx-lm's llama model loads: renamed, Q and K
rows un-permuted, then either kept quantized or dequantized to a dense dtype."""

from __future__ import annotations

import re
from typing import Any

from batchsim.server.models.gguf.reader import GROUP_SIZE, Gguf, GgufError

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PARTS = ("weight", "scales", "biases")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_TOP = re.compile(r"(\w+)\.(weight|scales|biases)$")


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.scales` -> `model.layers.3.self_attn.q_proj.scales`."""
    if m := _BLOCK.match(gguf_name):
        layer, kind, part = m.groups()
        if kind in BLOCK_NAMES:
            return f"model.layers.{layer}.{BLOCK_NAMES[kind]}.{part}"
    elif (m := _TOP.match(gguf_name)) and m.group(1) in TOP_NAMES:
        return f"{TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise GgufError(f"tensor {gguf_name!r} has no place in a llama model "
                    f"(known: {', '.join([*TOP_NAMES, *BLOCK_NAMES])})")


def unpermute_rows(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's convert_hf_to_gguf permutation of Q/K rows (its RoPE pairs adjacent values,
    Hugging Face's pairs the two halves of each head). Applies to weights, scales and biases
    alike."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GgufError(f"cannot un-permute {rows} rows for {n_head} heads")
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: Any, n_head: int) -> Any:
    """llama.cpp's permutation (what the converter did): the inverse of `unpermute_rows`."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(g: Gguf, n_heads: int, n_kv_heads: int) -> dict[str, Any]:
    """Every tensor under its Hugging Face name, Q and K rows back in Hugging Face order."""
    heads_of = {"attn_q": n_heads, "attn_k": n_kv_heads}
    out = {}
    for name, arr in g.tensors.items():
        kind = name.split(".")[-2]
        if kind in heads_of:
            arr = unpermute_rows(arr, heads_of[kind])
        out[hf_name(name)] = arr
    return out


def quantized_bits(weights: dict[str, Any], base: str) -> int:
    """Bits per value of a quantized matrix, from its packed and scale shapes."""
    packed_cols = weights[f"{base}.weight"].shape[-1]
    groups = weights[f"{base}.scales"].shape[-1]
    return packed_cols * 32 // (groups * GROUP_SIZE)


def quantized_bases(weights: dict[str, Any]) -> list[str]:
    return sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))


def dequantized(weights: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Dense weights in `dtype` (dequantized in float32, then cast)."""
    import mlx.core as mx

    mx_dtype = getattr(mx, dtype)
    out = {}
    for base in quantized_bases(weights):
        w, s, b = (weights[f"{base}.{p}"] for p in PARTS)
        dense = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                              group_size=GROUP_SIZE, bits=quantized_bits(weights, base))
        out[f"{base}.weight"] = dense.astype(mx_dtype)
    for name, arr in weights.items():
        base = name.rsplit(".", 1)[0]
        if base not in out and f"{base}.weight" not in out:
            out[name] = arr.astype(mx_dtype)
    return out


def kept_quantized(weights: dict[str, Any], dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Packed weights as they are, scales, biases and float tensors in `dtype` (float16 scales
    are far slower on MLX's CPU backend); and config.json's quantization block."""
    import mlx.core as mx

    mx_dtype = getattr(mx, dtype)
    out = {k: (v if v.dtype == mx.uint32 else v.astype(mx_dtype)) for k, v in weights.items()}
    bits = {base: quantized_bits(weights, base) for base in quantized_bases(weights)}
    if not bits:
        return out, {}
    common = max(set(bits.values()), key=list(bits.values()).count)
    block: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    block.update({base: {"group_size": GROUP_SIZE, "bits": b} for base, b in bits.items()
                  if b != common})
    return out, block


def _expected_rows_cols(c: dict[str, Any]) -> dict[str, tuple[int, int | None]]:
    """(rows, columns) of each llama tensor kind; norms are vectors (no columns)."""
    q, kv, ffn, hidden = (c["num_attention_heads"] * c["head_dim"],
                          c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"],
                          c["hidden_size"])
    return {"token_embd": (c["vocab_size"], hidden), "output": (c["vocab_size"], hidden),
            "output_norm": (hidden, None), "attn_norm": (hidden, None), "ffn_norm": (hidden, None),
            "attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
            "attn_output": (hidden, q), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn)}


def check_tensors(g: Gguf, config: dict[str, Any]) -> None:
    """Every tensor the config needs is there with its shape, and none beyond the block count:
    one line naming the first that is not (before anything is written)."""
    layers = config["num_hidden_layers"]
    needed = ["token_embd.weight", "output_norm.weight"]
    needed += [f"blk.{i}.{kind}.weight" for i in range(layers) for kind in BLOCK_NAMES]
    missing = [n for n in needed if n not in g.tensors]
    if missing:
        raise GgufError(f"{g.path}: no tensor {missing[0]} (block_count {layers}; "
                        f"{len(missing)} missing)")
    shapes = _expected_rows_cols(config)
    for name, arr in g.tensors.items():
        hf_name(name)  # a tensor a llama has no place for is refused by name
        m = _BLOCK.match(name)
        if m and int(m.group(1)) >= layers:
            raise GgufError(f"{g.path}: tensor {name} is beyond block_count {layers}")
        kind = m.group(2) if m else name.split(".")[0]
        rows, cols = shapes[kind]
        quantized = f"{name.rsplit('.', 1)[0]}.scales" in g.tensors  # packed columns
        want = (rows,) if cols is None or quantized else (rows, cols)
        got = tuple(arr.shape) if cols is None else tuple(arr.shape[: len(want)])  # norms: 1-D
        if 0 in arr.shape or got != want:
            raise GgufError(f"{g.path}: tensor {name} has shape {tuple(arr.shape)}, expected "
                            f"{' x '.join(map(str, want))}{' x ...' if quantized else ''}")

"""GGUF import on small synthetic files written with mx.save_gguf: Q/K rows back in Hugging Face
order (quantized rows moving with their scales and biases), names and config mlx-lm loads, the
tokenizer rebuilt from metadata, and one-line errors for what the importer does not handle."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from batchsim.configs import ConfigError

from tests.cli_calls import last_json

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN = 4, 2, 16, 64, 128


def _llama_meta(mx, **changes) -> dict:
    from tokenizers import pre_tokenizers

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)
    meta = {
        "general.architecture": "llama", "llama.block_count": u32(1),
        "llama.embedding_length": u32(HIDDEN), "llama.feed_forward_length": u32(FFN),
        "llama.attention.head_count": u32(HEADS), "llama.attention.head_count_kv": u32(KV_HEADS),
        "llama.rope.dimension_count": u32(HEAD_DIM), "llama.context_length": u32(256),
        "llama.rope.freq_base": mx.array(10000.0), "llama.vocab_size": u32(len(tokens)),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * (len(tokens) - 3), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1), "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}"
                                   "<|im_end|>{% endfor %}",
    }
    meta.update(changes)
    return meta


def _hf_weights(mx, vocab: int) -> dict:
    mx.random.seed(0)
    shapes = {
        "model.embed_tokens.weight": (vocab, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.norm.weight": (HIDDEN,),
    }
    return {k: mx.random.normal(s) * 0.1 for k, s in shapes.items()}


def _write_gguf(path: Path, hf: dict, **meta_changes) -> Path:
    """What llama.cpp's converter writes: GGUF names, Q and K rows permuted for its RoPE."""
    import mlx.core as mx
    from batchsim.server.models.gguf.weights import BLOCK_NAMES, TOP_NAMES, permute_rows

    to_gguf = {f"model.layers.0.{v}": f"blk.0.{k}" for k, v in BLOCK_NAMES.items()}
    to_gguf.update({v: k for k, v in TOP_NAMES.items()})
    tensors = {}
    for name, w in hf.items():
        base = name.rsplit(".", 1)[0]
        if base.endswith("q_proj"):
            w = permute_rows(w, HEADS)
        elif base.endswith("k_proj"):
            w = permute_rows(w, KV_HEADS)
        tensors[f"{to_gguf[base]}.weight"] = w.astype(mx.float16) if w.ndim == 2 else w
    mx.save_gguf(str(path), tensors, _llama_meta(mx, **meta_changes))
    return path


def _set_tensor_type(path: Path, tensor: str, type_id: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


def test_unpermute_puts_each_heads_rope_halves_back():
    # llama.cpp interleaves each head's two RoPE halves: GGUF row 2t+j is HF row j*half+t.
    import mlx.core as mx
    from batchsim.server.models.gguf.weights import permute_rows, unpermute_rows

    hf = mx.arange(2 * 8).reshape(16, 1)  # 2 heads of 8 rows
    gguf = permute_rows(hf, 2)
    assert gguf[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert mx.array_equal(unpermute_rows(gguf, 2), hf)


def test_quantized_rows_move_with_their_scales_and_biases():
    import mlx.core as mx
    from batchsim.server.models.gguf.weights import permute_rows, unpermute_rows

    w = mx.random.normal((HEADS * HEAD_DIM, HIDDEN), key=mx.random.key(1))
    ref = mx.dequantize(*mx.quantize(w, group_size=32, bits=4), group_size=32, bits=4)
    packed = mx.quantize(permute_rows(w, HEADS), group_size=32, bits=4)  # as the GGUF holds it
    back = [unpermute_rows(a, HEADS) for a in packed]
    assert mx.array_equal(mx.dequantize(*back, group_size=32, bits=4), ref)


def test_a_synthetic_llama_imports_and_loads_through_mlx_lm(tmp_path):
    import mlx.core as mx
    import mlx_lm
    from batchsim.server.models.imported import import_gguf
    from mlx.utils import tree_flatten

    hf = _hf_weights(mx, vocab=262)
    src = _write_gguf(tmp_path / "t.gguf", hf)
    out = import_gguf(src, tmp_path / "model", dtype="float32")
    model, tok = mlx_lm.load(str(out))
    got = dict(tree_flatten(model.parameters()))
    for name, w in hf.items():  # F16 matrices: equal to float16 precision, rows in HF order
        assert mx.allclose(got[name], w, atol=1e-3).item(), name
    assert tok.eos_token_id == 2 and tok.bos_token == "<|im_start|>"
    ids = tok.encode("a the 42\tt", add_special_tokens=False)
    assert 262 - 1 in ids  # "Ġthe", the last merge, is used
    assert tok.decode(ids) == "a the 42\tt" and tok.encode("<|im_end|>") == [2]
    assert tok.encode("123",
                      add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "123"]


@pytest.mark.parametrize("change, says", [
    ({"general.architecture": "gemma3"},
     "architecture 'gemma3' is not supported; supported: llama"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer model 'llama' is not supported"),
    ({"tokenizer.ggml.pre": "qwen2"}, "pre-tokenizer 'qwen2' is not supported"),
])
def test_unsupported_files_are_one_line_errors(tmp_path, change, says):
    import mlx.core as mx
    from batchsim.server.models.imported import import_gguf

    src = _write_gguf(tmp_path / "t.gguf", _hf_weights(mx, vocab=262), **change)
    with pytest.raises(ConfigError, match=says) as err:
        import_gguf(src, tmp_path / "model", dtype="float32")
    assert "\n" not in str(err.value) and not (tmp_path / "model").exists()


def test_unsupported_tensor_types_and_non_gguf_files_are_named(tmp_path):
    import mlx.core as mx
    from batchsim.server.models.gguf.reader import read_gguf

    src = _write_gguf(tmp_path / "t.gguf", _hf_weights(mx, vocab=262))
    _set_tensor_type(src, "blk.0.ffn_up.weight", 14)
    with pytest.raises(ConfigError, match=r"tensor blk.0.ffn_up.weight is Q6_K; supported tensor "
                                          r"types: F32, F16, Q4_0, Q4_1, Q8_0"):
        read_gguf(src)
    (tmp_path / "x.gguf").write_text("not a model")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        read_gguf(tmp_path / "x.gguf")


def test_models_import_command_writes_a_loadable_directory(tmp_path, capsys):
    import json

    import mlx.core as mx
    from batchsim.scripts.cli import main

    src = _write_gguf(tmp_path / "t.gguf", _hf_weights(mx, vocab=262))
    out = tmp_path / "imported"
    assert main(["models", "import", str(src), "--out", str(out), "--form", "dense", "--json"]) == 0
    doc = last_json(capsys.readouterr().out)
    assert doc["path"] == str(out) and doc["form"] == "dense"
    assert json.loads((out / "batchsim.json").read_text())["weights"] == "real"
    assert main(["models", "import", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("nope.gguf: no such file") and "\n" not in err


def test_a_repeated_token_string_that_shadows_no_special_id_imports(tmp_path, capsys):
    """Real vocabularies repeat some strings: any repeat was refused (08cc81b); the string reads
    as its last id, as llama.cpp's token_to_id does."""
    import mlx.core as mx
    from batchsim.scripts.cli import main
    from tokenizers import Tokenizer

    tokens = _llama_meta(mx)["tokenizer.ggml.tokens"]
    tokens = tokens[:-4] + ["Ġthe", *tokens[-3:]]  # "Ġthe" at ids 258 and 261
    src = _write_gguf(tmp_path / "t.gguf", _hf_weights(mx, vocab=262),
                      **{"tokenizer.ggml.tokens": tokens})
    out = tmp_path / "imported"
    assert main(["models", "import", str(src), "--out", str(out), "--form", "dense"]) == 0, (
        capsys.readouterr().err)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode(" the").ids == [261] and tok.id_to_token(2) == "<|im_end|>"


def _nested_arrays(path: Path, depth: int = 2000) -> Path:
    """A 24 KB GGUF whose one metadata value is an array nested `depth` deep."""
    key = b"general.nested"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    body = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1)
    path.write_bytes(head + body + struct.pack("<IQI", 4, 1, 7))
    return path


def _bad_gguf(kind: str, path: Path) -> Path:
    import mlx.core as mx

    hf = _hf_weights(mx, vocab=262)
    u32 = lambda v: mx.array(v, dtype=mx.uint32)
    if kind == "nested":
        return _nested_arrays(path)
    if kind == "missing":
        del hf["model.layers.0.mlp.up_proj.weight"]
    if kind == "zero_dim":
        hf["model.layers.0.mlp.up_proj.weight"] = mx.zeros((0, HIDDEN))
    if kind == "norm_2d":
        hf["model.layers.0.input_layernorm.weight"] = mx.zeros((HIDDEN, 2))
    meta = {"head_count": {"llama.attention.head_count": u32(0)},
            "eos": {"tokenizer.ggml.eos_token_id": u32(9999)},
            "blocks": {"llama.block_count": u32(2)},
            "epsilon": {"llama.attention.layer_norm_rms_epsilon": mx.array(-1e-5)},
            "merges": {"tokenizer.ggml.merges": ["Ġ t", "x y"]},  # no token xy
            "merges_int": {"tokenizer.ggml.merges": u32(4)},
            "tokens_int": {"tokenizer.ggml.tokens": u32(5)},
            "template_int": {"tokenizer.chat_template": u32(3)},
            "template_syntax": {"tokenizer.chat_template": "{% for %}"},
            "types_scalar": {"tokenizer.ggml.token_type": mx.array(3, dtype=mx.int32)},
            "types_short": {"tokenizer.ggml.token_type": mx.array([3, 3], dtype=mx.int32)},
            "dup_token": {"tokenizer.ggml.tokens": _llama_meta(mx)["tokenizer.ggml.tokens"][:-4]
                          + ["<|im_end|>", "Ġt", "he", "Ġthe"]},
            "dup_control": {"tokenizer.ggml.tokens": _llama_meta(mx)["tokenizer.ggml.tokens"][:-4]
                            + ["<|endoftext|>", "Ġt", "he", "Ġthe"]},
            "dup_user": {"tokenizer.ggml.token_type": mx.array([3, 3, 3, 4] + [1] * 258,
                                                               dtype=mx.int32),
                         "tokenizer.ggml.tokens": _llama_meta(mx)["tokenizer.ggml.tokens"][:-4]
                         + ["!", "Ġt", "he", "Ġthe"]},
            "dup_later_control": {  # '!' a normal token first, a control token at 258
                "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * 255 + [3] + [1] * 3,
                                                      dtype=mx.int32),
                "tokenizer.ggml.tokens": _llama_meta(mx)["tokenizer.ggml.tokens"][:-4]
                + ["!", "Ġt", "he", "Ġthe"]},
            "vocab_short": {"llama.vocab_size": u32(100)},
            "rope_partial": {"llama.rope.dimension_count": u32(HEAD_DIM // 2),
                             "llama.attention.key_length": u32(HEAD_DIM)},
            "rope_scaled": {"llama.rope.scaling.type": "linear",
                            "llama.rope.scaling.factor": mx.array(4.0)},
            "value_length": {"llama.attention.value_length": u32(HEAD_DIM // 2)},
            "experts": {"llama.expert_count": u32(8), "llama.expert_used_count": u32(2)},
            "bos_flag": {"tokenizer.ggml.add_bos_token": "false"}}.get(kind, {})
    return _write_gguf(path, hf, **meta)


@pytest.mark.parametrize("kind, says", [
    ("head_count", "llama.attention.head_count must be an integer in 1.."),  # ZeroDivisionError
    ("eos", "tokenizer.ggml.eos_token_id 9999 is not a token id"),  # was an IndexError
    ("nested", "metadata arrays nested deeper than 8"),  # was a RecursionError
    ("blocks", "no tensor blk.1.attn_norm.weight (block_count 2"),  # imported, then failed in run
    ("missing", "no tensor blk.0.ffn_up.weight"),
    ("zero_dim", "tensor blk.0.ffn_up.weight has shape (0, 64), expected 128 x 64"),
    ("epsilon", "layer_norm_rms_epsilon must be a positive finite number, got -"),
    ("merges", "tokenizer metadata does not make a BPE tokenizer (Error while initializing BPE"),
    # each of these was a TypeError traceback, or imported and then failed in `run`:
    ("norm_2d", "tensor blk.0.attn_norm.weight has shape (64, 2), expected 64"),
    ("merges_int", "tokenizer.ggml.merges must be an array of strings, got 4"),
    ("tokens_int", "tokenizer.ggml.tokens must be an array of strings, got 5"),
    ("template_int", "tokenizer.chat_template must be a string, got 3"),
    ("template_syntax", "tokenizer.chat_template is not a Jinja template (line 1: Expected an"),
    # h8: a TypeError traceback, then contradictions that imported and ran wrongly
    ("types_scalar", "tokenizer.ggml.token_type must be an array of 262 integers"),
    ("types_short", "tokenizer.ggml.token_type must be an array of 262 integers"),
    ("dup_token", "tokenizer.ggml.eos_token_id 2 is '<|im_end|>', listed again as id 258"),
    # r4: any other special token repeated imported, its string mapped to the later id
    ("dup_control", "token 0 '<|endoftext|>' (control) is listed again as id 258"),
    ("dup_user", "token 3 '!' (user-defined) is listed again as id 258"),
    # a normal token repeated later as a control token imported, its text read as the control
    ("dup_later_control", ("token 258 '!' (control) is also listed as id 3 (a normal token): "
                           "the string would read as the special one")),
    ("vocab_short", "llama.vocab_size 100 is less than the 262 tokens"),
    ("rope_partial", "llama.rope.dimension_count 8 differs from the head dimension 16"),
    ("rope_scaled", "llama.rope.scaling.type 'linear' is not supported"),
    ("value_length", "llama.attention.value_length 8 differs from the head dimension 16"),
    ("experts", "llama.expert_count 8: mixture-of-experts GGUFs are not supported"),
    ("bos_flag", "tokenizer.ggml.add_bos_token must be a boolean, got false"),
])
def test_malformed_ggufs_are_refused_in_one_line_before_anything_is_written(
        tmp_path, capsys, kind, says):
    from batchsim.scripts.cli import main

    src = _bad_gguf(kind, tmp_path / "bad.gguf")
    out = tmp_path / "models" / "imported"
    assert main(["models", "import", str(src), "--out", str(out), "--form", "dense"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err, err
    assert not out.parent.exists() or not list(out.parent.iterdir())  # no model, no build dir

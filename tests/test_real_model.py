"""The real-weight default model (SmolLM2-135M-Instruct from the pinned PyPI package, imported
from its GGUF): real answers, a tokenizer that round-trips, batched equals single on real
prompts, EOS ending requests, and `batchsim serve` answering a chat completion."""

from __future__ import annotations

import pytest
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.workloads.chat import chat_token_ids

from tests.backend import assert_same_tokens
from tests.drivers import config, drive

MODEL = "smollm2-135m-instruct"
# Short greedy replies: "The capital of France is Paris." (7 tokens), "A tomato is both ..." (10).
PROMPTS = ["What is the capital of France?",
           "Is a tomato a fruit or a vegetable? Answer in one word."]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def real(batchsim_home):
    from batchsim.server.models.loader import load, resolve

    ref = resolve(MODEL, "float32")
    model, tokenizer = load(ref)
    return ref, model, tokenizer


def _run(real, prompts: list[list[int]], max_tokens: int, max_num_seqs: int):
    ref, model, tok = real
    eos = frozenset(tok.eos_token_ids)
    kvt = ref.spec.kv_bytes_per_token(ref.dtype)
    sched = Scheduler(config(kv_bytes_per_token=kvt, max_num_seqs=max_num_seqs))
    sampling = SamplingParams(max_tokens=max_tokens)  # EOS honoured, greedy
    arrivals = [(0, Request(i, len(ids), sampling, 0.0, prompt_token_ids=ids, eos_token_ids=eos))
                for i, ids in enumerate(prompts)]
    return drive(sched, MLXExecutor(model), arrivals).requests


def test_the_zoo_entry_is_real_and_the_default(real):
    from batchsim.server.engine.run_config import RunConfig

    ref, _, _ = real
    assert ref.weights == "real" and RunConfig().model == MODEL
    assert ref.spec.summary()["weights"] == "real"


def test_greedy_answer_names_paris(real):
    import mlx_lm

    _, model, tok = real
    ids = chat_token_ids(tok, "What is the capital of France?")
    assert "Paris" in mlx_lm.generate(model, tok, ids, max_tokens=8)


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "Pi is 3.14159, and 2026 - 1999 = 27.",
    "def f(x):\n\tif x > 0:\n\t\treturn x * 2\n\treturn -x\n",
    "I love pizza 🍕 and café ☕️ — naïve façade!",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
])
def test_tokenizer_round_trips(real, text):
    _, _, tok = real
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_tokenizer_agrees_with_the_gguf_vocabulary(real):
    # Specials by the GGUF's ids, digits split one by one, and regular tokens re-encode to
    # themselves (a wrong merge order or pre-tokenizer would break many).
    _, _, tok = real
    assert tok.encode("<|im_start|><|im_end|>", add_special_tokens=False) == [1, 2]
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    digits = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == list("12345")
    sample = range(17, tok.vocab_size if hasattr(tok, "vocab_size") else 49152, 61)
    texts = [(i, tok.decode([i])) for i in sample]
    same = sum(tok.encode(t,
                          add_special_tokens=False) == [i] for i, t in texts if "\ufffd" not in t)
    assert same >= 0.97 * len(texts)


def test_batched_equals_single_on_chat_prompts_and_eos_stops(real):
    tok = real[2]
    eos = frozenset(tok.eos_token_ids)
    prompts = [chat_token_ids(tok, p) for p in PROMPTS]
    batched = _run(real, prompts, MAX_TOKENS, max_num_seqs=len(prompts))
    alone = {i: _run(real, [ids], MAX_TOKENS, 1)[0] for i, ids in enumerate(prompts)}
    assert_same_tokens(real[1], dict(enumerate(prompts)),
                       {i: r.output_token_ids for i, r in batched.items()},
                       {i: r.output_token_ids for i, r in alone.items()})
    paris = batched[0]  # "The capital of France is Paris." then EOS, well before max_tokens
    assert paris.finish_reason == "stop" and paris.output_token_ids[-1] in eos
    assert len(paris.output_token_ids) < MAX_TOKENS
    assert "Paris" in tok.decode(paris.output_token_ids)
    assert all(r.output_token_ids[-1] in eos for r in batched.values() if r.finish_reason == "stop")


def test_kept_quantized_form_dequantizes_to_the_dense_import(real):
    import mlx.core as mx
    from batchsim.server.models.gguf.importer import KEEP, convert
    from batchsim.server.models.packaged import gguf_path

    ref, model, _ = real
    config, weights, _ = convert(gguf_path(ref.spec.package), KEEP, "float32")
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8  # this file's Q8_0 embedding
    base = "model.layers.3.self_attn.k_proj"
    dense = mx.dequantize(*(weights[f"{base}.{p}"] for p in ("weight", "scales", "biases")),
                          group_size=32, bits=4)
    assert mx.allclose(dense, model.model.layers[3].self_attn.k_proj.weight, atol=1e-6).item()


def test_serve_answers_a_chat_completion(real, batchsim_home):
    from tests.serve_process import ServerProcess

    srv = ServerProcess(batchsim_home, "--model", MODEL, "--max-num-seqs", "2")
    try:
        body = {"model": MODEL, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        reply = srv.client.post("/v1/chat/completions", json=body).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
    finally:
        srv.stop()


def _cli(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    import json

    from batchsim.scripts.cli import main

    rc = main(argv)
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return rc, (json.loads(lines[-1]) if rc == 0 else None), captured.err


def test_models_and_run_summaries_say_which_weights(capsys, tmp_path, batchsim_home):
    rc, doc, _ = _cli(capsys, ["models", "--json"])
    assert rc == 0
    weights = {m["name"]: m["weights"] for m in doc["models"]}
    assert weights[MODEL] == "real" and weights["smollm2-135m"] == "random"
    assert {w for n, w in weights.items() if n != MODEL} == {"random"}
    for model, expected in ((MODEL, "real"), ("tiny", "random")):
        rc, summary, _ = _cli(capsys, ["run", "--model", model, "--executor", "fake",
                                       "--num-prompts", "6", "--request-rate",
                                       "inf", "--no-progress",
                                       "--out", str(tmp_path)])
        assert rc == 0 and summary["env"]["weights"] == expected
    # Synthetic traffic ignores EOS: every request ends at its length, and the summary's output
    # length percentiles are those of the records.
    import json
    from pathlib import Path

    text = (Path(summary["run_dir"]) / "requests.jsonl").read_text()
    rows = [json.loads(x) for x in text.split("\n") if x]
    lengths = sorted(r["num_output_tokens"] for r in rows)
    assert summary["finish_reasons"] == {"length": 6}
    assert summary["max_output_tokens"] == lengths[-1]
    assert summary["median_output_tokens"] == (lengths[2] + lengths[3]) / 2


def test_a_chat_workload_needs_the_models_tokenizer(capsys, tmp_path):
    rc, _, err = _cli(capsys, ["run", "--workload", "chat", "--executor", "fake", "--model", "tiny",
                               "--no-progress", "--out", str(tmp_path)])
    assert rc == 2 and "needs the model's tokenizer" in err.strip().splitlines()[-1]
    assert "Traceback" not in err

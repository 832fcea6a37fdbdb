"""The OpenAI-compatible HTTP API (``kvservice api``, a process of a local stack over two
SmolLM2 workers) through the official ``openai`` client, unmodified, and through plain
HTTP where a client would (curl): chats, streams, parallel samples, the prefix cache in
``usage``, stop strings, errors in OpenAI's shape, a stream cancelled by its client, the
metrics."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from helpers import used_blocks, wait_for

from kvservice.tools.launcher import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence, in plain words, "
                                       "and say so when you do not know the answer."}


@pytest.fixture(scope="module")
def stack(smollm2_cache):
    with Stack(2, model=MODEL, block_size=16, num_blocks=256, http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def api(stack):
    with openai.OpenAI(base_url=stack.api.url, api_key=stack.api_key, max_retries=0, timeout=120) as c:
        yield c


def _http(stack, method: str, path: str, body: dict | bytes | None = None, key: str | None = None):
    """(status, JSON body) of a plain HTTP call."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(stack.api.url.removesuffix("/v1") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {stack.api_key if key is None else key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw and r.headers.get_content_type() == "application/json" else raw
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_served_model(api):
    models = api.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "kvservice"
    assert api.models.retrieve(MODEL).id == MODEL


def test_a_chat_completion_answers_in_text_and_ends_at_the_end_of_sequence(api):
    r = api.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "What is the capital "
                                                                                               "of France?"}],
                                    max_tokens=100, temperature=0)
    (choice,) = r.choices
    text = choice.message.content
    assert choice.message.role == "assistant" and "Paris" in text
    assert choice.finish_reason == "stop" and r.usage.completion_tokens < 100
    assert "<|im_start|>" not in text and "<|im_end|>" not in text
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens and r.usage.prompt_tokens > 30
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL


def test_a_second_chat_with_the_same_system_prompt_hits_the_prefix_cache(api):
    asks = ["Name a colour.", "Name a fruit."]
    usages = [api.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": a}],
                                          max_tokens=16, temperature=0).usage for a in asks]
    assert usages[1].prompt_tokens_details.cached_tokens > 0
    # whole blocks of the shared system prompt, never more than the prompt
    assert usages[1].prompt_tokens_details.cached_tokens % 16 == 0
    assert usages[1].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens


def test_a_streamed_chat_sends_its_tokens_before_the_end(api):
    arrivals, parts, reasons = [], [], []
    stream = api.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Tell me a "
                                                                                                    "story."}],
                                         max_tokens=24, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                arrivals.append(time.monotonic())
                parts.append(c.delta.content)
            if c.finish_reason:
                reasons.append((c.finish_reason, time.monotonic()))
    assert len(parts) >= 5 and len(reasons) == 1
    assert arrivals[0] < reasons[0][1]                  # the first tokens came before the last
    whole = api.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Tell me a "
                                                                                                   "story."}],
                                        max_tokens=24, temperature=0)
    assert "".join(parts) == whole.choices[0].message.content     # the same text, in pieces
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_n_4_samples_fork_after_one_prefill_and_are_reproducible(api):
    ask = dict(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Suggest a name for a cat."}],
               max_tokens=16, temperature=0.9, top_p=0.95, seed=11, n=4)
    first, second = api.chat.completions.create(**ask), api.chat.completions.create(**ask)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]        # same seed, same samples
    assert len(set(texts)) > 1
    assert 4 <= first.usage.completion_tokens <= 4 * 16


def test_a_plain_completion_with_a_stop_string(api):
    free = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert free.finish_reason == "length"
    stop = " " + free.text.split()[3]
    cut = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                 stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.index(stop)]


def test_token_id_prompts_are_accepted_by_completions(api):
    ids = api.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    text = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == text.usage.prompt_tokens == 5
    assert ids.choices[0].text == text.choices[0].text and "Paris" in ids.choices[0].text


@pytest.mark.parametrize("ask, param", [
    (dict(temperature=-1), "temperature"),
    (dict(n=0), "n"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=100_000), "max_tokens"),          # past the context and every pool
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(extra_body={"frobnicate": True}), "frobnicate"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
])
def test_bad_requests_get_400_with_an_openai_error_body(api, ask, param):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    body.update(ask)
    with pytest.raises(openai.BadRequestError) as exc:
        api.chat.completions.create(**body)
    assert exc.value.status_code == 400
    error = exc.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error


def test_an_unknown_model_is_404_and_a_missing_key_401(api, stack):
    with pytest.raises(openai.NotFoundError) as exc:
        api.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    status, body = _http(stack, "GET", "/v1/models", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _http(stack, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert _http(stack, "GET", "/health", key="")[0] == 200      # health and metrics need no key


def test_a_stream_closed_by_its_client_is_cancelled_and_its_blocks_freed(api, stack):
    assert wait_for(lambda: used_blocks(stack) == 0)       # the other tests' requests are done
    stream = api.completions.create(model=MODEL, prompt="Count from one to a thousand: one, two, three,",
                                    max_tokens=500, temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = []
    for chunk in stream:
        got.append(chunk.choices[0].text)
        if len(got) == 3:
            break
    held = used_blocks(stack)
    assert held > 0
    stream.close()                                            # the client goes away mid-stream
    assert wait_for(lambda: used_blocks(stack) == 0), used_blocks(stack)
    metrics = _http(stack, "GET", "/metrics")[1].decode()
    assert 'kvservice_api_requests_total{endpoint="completions",status="499"} 1.0' in metrics


def test_a_request_that_cannot_wait_gets_429(stack):
    """A second API process (its own lease) that runs one sequence at a time and lets one
    request wait: a third request is refused at once, with Retry-After."""
    from kvservice.tools.launcher import ApiProcess

    with ApiProcess(stack.target, "--max-num-seqs", "1", "--max-waiting", "1",
                    env=stack._client_env("api")) as narrow, \
            openai.OpenAI(base_url=narrow.url, api_key="none", max_retries=0, timeout=120) as client:
        ask = dict(model=MODEL, prompt="Count: one, two, three,", temperature=0, extra_body={"ignore_eos": True})
        first = client.completions.create(max_tokens=120, stream=True, **ask)
        next(iter(first))                                     # running: it holds the one sequence
        second: list = []
        waiter = threading.Thread(target=lambda: second.append(client.completions.create(max_tokens=4, **ask)))
        waiter.start()

        def waiting() -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{narrow.port}/metrics", timeout=10).read().decode()
            return next(float(x.split()[-1]) for x in text.splitlines() if x.startswith("kvservice_api_requests_waiting"))
        assert wait_for(lambda: waiting() == 1)
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(max_tokens=4, **ask)
        assert exc.value.status_code == 429 and exc.value.body["code"] == "rate_limit_exceeded"
        assert exc.value.response.headers["retry-after"] == "1"
        rest = "".join(c.choices[0].text for c in first)
        waiter.join(120)
        assert rest and second and second[0].choices[0].finish_reason == "length"


def test_concurrent_requests_are_batched_and_all_answered(api):
    results: list = [None] * 6

    def ask(i: int) -> None:
        results[i] = api.chat.completions.create(
            model=MODEL, messages=[SYSTEM, {"role": "user", "content": f"What is {i} plus {i}?"}], max_tokens=12,
            temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and r.choices[0].message.content for r in results)


def test_metrics_show_latency_histograms_and_token_counters(stack, api):
    # (twice: the second chat's system prompt comes from the prefix cache, whatever the
    # module's other tests sent before)
    for _ in range(2):
        api.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Hi"}], max_tokens=4)
    status, raw = _http(stack, "GET", "/metrics")
    assert status == 200
    samples = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    for name in ('kvservice_api_time_to_first_token_seconds_count{endpoint="chat"}',
                 'kvservice_api_inter_token_latency_seconds_count{endpoint="chat"}',
                 'kvservice_api_e2e_request_latency_seconds_count{endpoint="chat"}',
                 'kvservice_api_requests_total{endpoint="chat",status="200"}',
                 "kvservice_api_prompt_tokens_total", "kvservice_api_generation_tokens_total",
                 "kvservice_api_cached_prompt_tokens_total"):
        assert samples.get(name, 0) > 0, name
    assert samples["kvservice_api_requests_running"] == 0 and samples["kvservice_api_requests_waiting"] == 0

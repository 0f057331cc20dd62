"""The server's OpenAI surface (issue 45 item 2), in process through FastAPI's TestClient over a random-init tiny
model served autoregressively (its output is noise; these tests check shapes, not text): /v1/chat/completions
whole and streamed (chat.completion / chat.completion.chunk, [DONE], usage, stop, max_tokens /
max_completion_tokens, seed), /v1/models/{id}, and OpenAI's error shape for every 4xx, FastAPI's own 404 / 405 / 422
included. The chat template: the tokenizer's own from tokenizer_config.json (jinja2), else the plain one. One
scheduler and app for the module (a few seconds of compiles on a CPU)."""

from __future__ import annotations

import importlib.util
import json

import pytest

missing = [m for m in ("fastapi", "httpx", "jinja2") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"the 'serve' extra is not installed ({', '.join(missing)})")

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def app_client():
    import kdtree_jax
    from fastapi.testclient import TestClient

    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.api import create_app
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.tokenizer import ByteTokenizer

    target = kdtree_jax.init_model(kdtree_jax.ModelConfig.preset("tiny"), seed=0)
    metrics = Metrics()
    scheduler = sched.Scheduler(target, None, sched.Settings(max_batch=2, max_len=256, budget=0, chunk_steps=2),
                                metrics)
    scheduler.start()
    app = create_app(scheduler, ByteTokenizer(), metrics, model_name="tiny", info={"decoding": "autoregressive"})
    with TestClient(app) as client:
        yield client, scheduler
    scheduler.stop(drain=False, timeout=60)


def _chat(client, **kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, **kw}
    return client.post("/v1/chat/completions", json=body)


def _events(response) -> list:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def _is_openai_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"], err
    assert err["param"] == param and (code is None or err["code"] == code), err
    return err


def test_chat_whole_and_streamed_give_the_same_answer(app_client):
    client, _ = app_client
    r = _chat(client, max_completion_tokens=8, max_tokens=None)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-") and whole["model"] == "tiny"
    (choice,) = whole["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    # The plain template: "user: Hi\nassistant:" is the prompt (byte tokenizer: one token a byte)
    assert whole["usage"] == {"prompt_tokens": len("user: Hi\nassistant:"), "completion_tokens": 8,
                              "total_tokens": len("user: Hi\nassistant:") + 8}

    r = _chat(client, stream=True, stream_options={"include_usage": True})
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert text == choice["message"]["content"] and finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])  # include_usage: null until the last chunk, as OpenAI's


def test_chat_stop_seed_and_the_room_left(app_client):
    client, _ = app_client
    text = _chat(client, max_tokens=24).json()["choices"][0]["message"]["content"]
    stop = next((text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip()), None)
    if stop is not None:
        r = _chat(client, max_tokens=24, stop=[stop]).json()["choices"][0]
        assert (r["message"]["content"], r["finish_reason"]) == (text[:text.find(stop)], "stop")
    sampled = [_chat(client, temperature=0.9, seed=7).json()["choices"][0]["message"]["content"] for _ in range(2)]
    assert sampled[0] == sampled[1]  # a lone seeded request is reproducible
    # Without max_tokens an answer may take the room its prompt leaves in a row
    r = _chat(client, max_tokens=None)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("pieces", [["héllo, STOP and the rest"], ["héllo, ST", "OP and the rest"]])
def test_usage_counts_the_tokens_up_to_the_stop_string(app_client, monkeypatch, pieces):
    """A chunk hands a request every token its steps made, so tokens past a stop string arrive with it: the text is
    cut at the stop, and completion_tokens counts the tokens up to it only, whole and streamed alike. The scheduler
    hands over a fixed answer (byte tokens: 'é' is two) in these pieces."""
    client, scheduler = app_client

    def submit(job):
        for piece in pieces:
            job.emit("tokens", list(piece.encode()))
        job.emit("done", "length")

    monkeypatch.setattr(scheduler, "submit", submit)
    kept = len("héllo, ".encode())
    r = _chat(client, max_tokens=64, stop="STOP").json()
    assert (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) == ("héllo, ", "stop")
    assert r["usage"]["completion_tokens"] == kept
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + kept
    chunks = [json.loads(e) for e in _events(_chat(client, max_tokens=64, stop="STOP", stream=True,
                                                   stream_options={"include_usage": True}))[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "héllo, "
    assert chunks[-1]["usage"]["completion_tokens"] == kept


def test_penalties_change_the_answer_in_the_same_program(app_client):
    """presence_penalty / frequency_penalty are each request's own settings (one compiled program for all)."""
    client, _ = app_client
    from kdtree_jax.speculative import engine

    plain = _chat(client, max_tokens=24).json()["choices"][0]["message"]["content"]
    traced = engine._TRACES.get("decode_chunk", 0)
    penalised = _chat(client, max_tokens=24, presence_penalty=2.0, frequency_penalty=2.0).json()
    assert penalised["choices"][0]["message"]["content"] != plain
    assert _chat(client, max_tokens=24, frequency_penalty=0.0).json()["choices"][0]["message"]["content"] == plain
    assert engine._TRACES.get("decode_chunk", 0) == traced


def test_sampling_fields_left_out_take_the_defaults(app_client, monkeypatch):
    """Each sampling field a request leaves out (or sends as null) takes create_app's sampling_defaults (the
    checkpoint's generation_config.json), else OpenAI's default (temperature 1); a field it sets wins; top_k -1 is
    off, as vLLM reads it. Checked on the Request the scheduler is handed."""
    from kdtree_jax.serve.api import create_app
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.tokenizer import ByteTokenizer
    from fastapi.testclient import TestClient

    client, scheduler = app_client
    submitted = []
    submit = scheduler.submit
    monkeypatch.setattr(scheduler, "submit", lambda req: (submitted.append(req), submit(req))[1])

    def settings(client, **body):
        submitted.clear()
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        (req,) = submitted
        return {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                             "presence_penalty", "frequency_penalty")}

    openai_defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                       "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert settings(client) == openai_defaults  # no generation_config.json: OpenAI's
    assert client.get("/health").json()["sampling_defaults"] == openai_defaults

    recommended = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3}
    app = create_app(scheduler, ByteTokenizer(), Metrics(), model_name="tiny", info={},
                     sampling_defaults=recommended)
    with TestClient(app) as configured:
        assert settings(configured) == {**openai_defaults, **recommended}
        assert settings(configured, temperature=None, top_k=None) == {**openai_defaults, **recommended}
        assert settings(configured, temperature=0.5, top_k=-1, presence_penalty=0.25) == {
            **openai_defaults, **recommended, "temperature": 0.5, "top_k": 0, "presence_penalty": 0.25}
        assert settings(configured, repetition_penalty=1) == {**openai_defaults, **recommended,
                                                              "repetition_penalty": 1.0}
        assert configured.get("/v1/models/tiny").json()["sampling_defaults"] == {**openai_defaults, **recommended}
    with pytest.raises(ValueError, match="top_p"):  # a bad recommendation fails when the app is made
        create_app(scheduler, ByteTokenizer(), Metrics(), model_name="tiny", info={},
                   sampling_defaults={"top_p": 0})


def test_models_and_model_by_id(app_client):
    client, _ = app_client
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    model = client.get("/v1/models/tiny").json()
    assert model["id"] == "tiny" and model["object"] == "model" and model["chat_template"] == "the plain template"
    _is_openai_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


@pytest.mark.parametrize("method,path,status,code", [
    ("get", "/v1/nope", 404, "not_found"),
    ("get", "/", 404, "not_found"),
    ("post", "/v1/models", 405, "method_not_allowed"),
    ("get", "/v1/chat/completions", 405, "method_not_allowed"),
    ("put", "/v1/completions", 405, "method_not_allowed"),
])
def test_unknown_routes_and_wrong_methods_are_openai_errors(app_client, method, path, status, code):
    client, _ = app_client
    err = _is_openai_error(getattr(client, method)(path), status, None, code)
    assert path in err["message"]


BAD_CHAT = [
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 6}, 400,
     "max_completion_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
      "max_completion_tokens": 4}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 1.5}, 400, "top_k"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": -1}, 400,
     "repetition_penalty"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "bogus": 1}, 400, "bogus"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}]}, 400, "prompt"),  # beyond a pool row
]


@pytest.mark.parametrize("body,status,param", BAD_CHAT)
def test_bad_chat_requests_are_openai_errors(app_client, body, status, param):
    client, _ = app_client
    _is_openai_error(client.post("/v1/chat/completions", json=body), status, param)


def test_text_parts_are_joined(app_client):
    client, _ = app_client
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    a = _chat(client, messages=[{"role": "user", "content": parts}]).json()
    b = _chat(client).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"] == b["usage"]


def test_the_tokenizers_chat_template_and_its_end_of_turn(tmp_path):
    """tokenizer_config.json's chat_template (jinja2, as Hugging Face renders it) and its eos_token as the stop
    string; a config without one: the plain template, whose turn ends at a new user line."""
    from kdtree_jax.serve import chat_template

    class Tok:
        files = (str(tmp_path / "tokenizer.json"),)

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": {"content": "<|im_end|>"}, "bos_token": "<s>"}))
    t = chat_template.for_tokenizer(Tok())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a < b & c"}]
    assert t.render(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na < b & c<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert t.end == "<|im_end|>" and t.origin.endswith("tokenizer_config.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ raise_exception('no system messages') }}"}]}))
    with pytest.raises(chat_template.TemplateError, match="no system messages"):
        chat_template.for_tokenizer(Tok()).render(messages)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    plain = chat_template.for_tokenizer(Tok())
    assert plain.render(messages) == "system: Be brief.\nuser: a < b & c\nassistant:" and plain.end == "\nuser:"


def test_a_template_that_refuses_the_messages_is_a_400(app_client):
    from kdtree_jax.serve import chat_template
    from kdtree_jax.serve.api import create_app
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.tokenizer import ByteTokenizer
    from fastapi.testclient import TestClient

    _, scheduler = app_client
    strict = chat_template.ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('users first') }}"
                                        "{% endif %}{{ messages[0].content }}", origin="a test")
    app = create_app(scheduler, ByteTokenizer(), Metrics(), model_name="tiny", info={}, template=strict)
    client = TestClient(app)
    err = _is_openai_error(client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "assistant", "content": "x"}]}), 400, "messages")
    assert "users first" in err["message"]

"""Serving a trained run: the byte tokenizer as tokenizer.json, continuous batching that gives every
request exactly what it would get alone (and what load_model's own decoding gives), request rules
(400), back-pressure (429), cancellation on disconnect, /health, chat completions through the model's
chat template, and the two command-line tools.

Servers run in this process on 127.0.0.1 and a free port, and are always shut down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch

from tests.helpers import REPO, finished_run, import_optional, keeping_mtimes
from tests.zygote import launch_command

import_optional("transformers")
import_optional("fastapi")
import_optional("uvicorn")
httpx = import_optional("httpx")

import ddptrain  # noqa: E402
from ddptrain.generate import SEPARATOR  # noqa: E402
from ddptrain.generation.generator import Generator, SamplingParams, _draw  # noqa: E402
from ddptrain.serving.server import build_app  # noqa: E402
from ddptrain.serving.servable import MARKER, byte_tokenizer, servable_dir  # noqa: E402
from ddptrain.testing import free_port  # noqa: E402

CONTEXT = 64
# Long enough to predict more than one repeated character greedily; ~10 s on one CPU core.
TRAIN = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.max_docs=40", "trainer.max_steps=300",
         "trainer.log_every=300", "optim.warmup_steps=10", "trainer.eval_examples=8", f"batch.seq_len={CONTEXT}",
         "batch.global_size=16", "batch.micro_size=16", "optim.lr=1e-2",
         "data.order=permutation"]  # the model these prompts were chosen on (16 different greedy texts)
PROMPTS = ["def __init__(self", "import ", "class Foo", "    return ", "if __name__", "for i in range(", "# Copyright",
           "raise ValueError(", "self.", "from . import", "print(", "with open(", "try:\n    ", "lambda x:", "    def ",
           '"""Return the']


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return finished_run(tmp_path_factory, "served", TRAIN)


@pytest.fixture(scope="module")
def model(run_dir):
    return ddptrain.load_model(run_dir)


# A plain-text template (the byte tokenizer has no special tokens): each message in role markers, then
# the assistant's turn opened; a system message anywhere but first is refused by the template itself.
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{% if message['role'] == 'system' and not loop.first %}"
                 "{{ raise_exception('a system message must come first') }}{% endif %}"
                 "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
CHATS = [[{"role": "user", "content": "Foo"}, {"role": "assistant", "content": ":"}, {"role": "user", "content": "x"}],
         [{"role": "system", "content": "code"}, {"role": "user", "content": "import "}],
         [{"role": "user", "content": "def f("}],
         [{"role": "user", "content": "    return "}],
         [{"role": "user", "content": "print("}],
         [{"role": "user", "content": "self."}]]
"""Conversations that render to 54, 47 and 24 + len(content) tokens: room for 6 + 3 * index more."""


def rendered(messages: list[dict]) -> str:
    """What CHAT_TEMPLATE renders for `messages` with add_generation_prompt, written out by hand."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


@pytest.fixture(scope="module")
def chat_dir(run_dir, tmp_path_factory):
    """The run's servable directory with CHAT_TEMPLATE saved beside its byte tokenizer."""
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(servable_dir(run_dir), directory)
    PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    assert (directory / "chat_template.jinja").is_file()
    return directory


@contextlib.contextmanager
def serving(run_dir, **options):
    """An in-process server on 127.0.0.1:<free port>; yields (url, generator); always shut down."""
    import uvicorn

    generator = Generator(servable_dir(run_dir), device="cpu", **options)
    server = uvicorn.Server(uvicorn.Config(build_app(generator), host="127.0.0.1", port=free_port(),
                                           log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.config.port}", generator
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not shut down"


def greedy_ids(model, prompt: str, max_tokens: int) -> list[int]:
    """load_model's own greedy decoding: the whole sequence through the model for every token."""
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0, -max_tokens:].tolist()


def sampled_ids(model, prompt: str, max_tokens: int, temperature: float, top_p: float, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        for _ in range(max_tokens):
            token = _draw(model(ids)[0, -1], temperature, top_p, generator)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return ids[0, -max_tokens:].tolist()


def text_of(ids: list[int]) -> str:
    return byte_tokenizer().decode(ids)


async def complete(client, url: str, **body) -> dict:
    response = await client.post(url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def stream(client, url: str, started: asyncio.Event | None = None, **body) -> dict:
    """A streamed completion: its text, finish reason, usage and when its first and last pieces arrived
    (perf_counter); `started` is set at the first piece."""
    times, pieces, last = [], [], None
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                if last["choices"][0]["text"]:
                    times.append(time.perf_counter())
                    pieces.append(last["choices"][0]["text"])
                    if started is not None:
                        started.set()
    return {"text": "".join(pieces), "finish_reason": last["choices"][0]["finish_reason"], "usage": last["usage"],
            "first": times[0], "last": times[-1]}


async def chat(client, url: str, **body) -> dict:
    response = await client.post(url + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["choices"][0]["message"]["role"] == "assistant"
    return answer


async def chat_stream(client, url: str, **body) -> dict:
    """A streamed chat completion: its chunks (chat.completion.chunk objects, in order) and their text."""
    chunks, lines = [], []
    async with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
                if line != "data: [DONE]":
                    chunks.append(json.loads(line.removeprefix("data: ")))
    assert lines[-1] == "data: [DONE]" and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    return {"chunks": chunks, "text": "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)}


# -- the byte tokenizer and the servable directory ---------------------------------------------------


def test_byte_tokenizer_ids_are_the_bytes_and_text_round_trips(tmp_path):
    rng = random.Random(0)
    ranges = [(0, 0x20), (0x20, 0x7F), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    texts = ["", "a", "  two  spaces\n\ttab", "héllo wörld 日本語 🎉", "\x00\x7f\x80", "x" * 3000]
    texts += ["".join(chr(rng.randrange(*rng.choice(ranges))) for _ in range(rng.randrange(1, 40))) for _ in range(200)]
    tokenizer = byte_tokenizer()
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert ids == list(text.encode()), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.get_vocab_size() == 256
    # transformers reads the written directory with the same ids
    from transformers import AutoTokenizer

    from ddptrain.serving.servable import write_byte_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 64}))
    write_byte_tokenizer(tmp_path)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tokenizer("héllo 🎉", add_special_tokens=False).input_ids == list("héllo 🎉".encode())


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_servable_dir_of_a_run_is_made_once_and_remade_when_the_weights_contents_change(run_dir, model, tmp_path):
    from transformers import AutoModelForCausalLM

    from ddptrain.models.spec import ModelSpec
    from ddptrain.runs.weights import save_final

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    directory = servable_dir(run)
    assert directory == run / "servable" and (directory / "tokenizer.json").is_file()
    idx = torch.tensor([list(b"def main():\n    return 1")])
    with torch.no_grad():
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(directory)(idx).logits, model(idx), atol=1e-5)
    made = (directory / MARKER).stat().st_mtime_ns
    final = run / "final"
    spec = final / "ddptrain_model.json"
    other = ddptrain.load_model(run)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(0.5)
    meta = json.loads(spec.read_text())
    keeping_mtimes(final, lambda: save_final(run, other, other.state_dict(), ModelSpec.from_dict(meta), meta["step"],
                                             {}))  # other weights, every mtime as it was (cp -p, rsync -a)
    assert (servable_dir(run) / MARKER).stat().st_mtime_ns != made
    with torch.no_grad():
        served = AutoModelForCausalLM.from_pretrained(directory)(idx).logits
        assert torch.allclose(served, other(idx), atol=1e-5) and not torch.allclose(served, model(idx), atol=1e-3)
    made = (directory / MARKER).stat().st_mtime_ns
    os.utime(spec, ns=(spec.stat().st_atime_ns, spec.stat().st_mtime_ns + 10**9))  # touched, the same weights
    assert servable_dir(run) == directory and (directory / MARKER).stat().st_mtime_ns == made  # reused


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_damaged_servable_copy_is_rebuilt_and_a_truncated_model_directory_is_a_serve_error(run_dir, model, tmp_path):
    from transformers import AutoModelForCausalLM

    from ddptrain.generation.generator import ModelLoadError

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    weights = servable_dir(run) / "model.safetensors"
    idx = torch.tensor([list(b"def main():\n    return 1")])
    data = weights.read_bytes()
    keeping_mtimes(weights.parent, lambda: weights.write_bytes(data[:-64] + b"\x7f" * 64))  # same size, huge values
    with torch.no_grad():
        served = AutoModelForCausalLM.from_pretrained(servable_dir(run))(idx).logits
    assert torch.allclose(served, model(idx), atol=1e-5)  # rebuilt, not served damaged
    keeping_mtimes(weights.parent, lambda: weights.write_bytes(data[: len(data) // 2]))  # truncated
    with torch.no_grad():
        served = AutoModelForCausalLM.from_pretrained(servable_dir(run))(idx).logits
    assert torch.allclose(served, model(idx), atol=1e-5)

    copied = tmp_path / "copied"  # a transformers directory served as it is: a truncated file is named
    shutil.copytree(servable_dir(run), copied)
    (copied / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"copied: its model cannot be loaded .*truncated or damaged"):
        Generator(copied, device="cpu")


# -- continuous batching: the same tokens as alone ---------------------------------------------------


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_concurrent_greedy_requests_equal_one_at_a_time_and_load_models_decoding(run_dir, model):
    lengths = [8 + 5 * (i % 6) for i in range(len(PROMPTS))]  # different lengths end at different steps
    expected = [text_of(greedy_ids(model, prompt, n)) for prompt, n in zip(PROMPTS, lengths)]
    assert len(set(expected)) == len(expected)  # the prompts really lead to different texts

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            together = await asyncio.gather(*(complete(client, url, prompt=p, max_tokens=n, temperature=0)
                                              for p, n in zip(PROMPTS, lengths)))
            alone = [await complete(client, url, prompt=p, max_tokens=n, temperature=0)
                     for p, n in zip(PROMPTS, lengths)]
            streamed = await asyncio.gather(*(stream(client, url, prompt=p, max_tokens=n, temperature=0)
                                              for p, n in zip(PROMPTS, lengths)))
        return together, alone, streamed

    with serving(run_dir, max_active=16) as (url, _):
        together, alone, streamed = asyncio.run(main(url))
    assert [r["choices"][0]["text"] for r in together] == expected
    assert [r["choices"][0]["text"] for r in alone] == expected
    assert [r["text"] for r in streamed] == expected
    assert [r["usage"]["completion_tokens"] for r in together] == lengths
    assert {r["choices"][0]["finish_reason"] for r in together} == {"length"}


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_request_arriving_mid_decoding_starts_before_the_others_finish(run_dir):
    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event() for _ in range(4)]
            long = [asyncio.ensure_future(stream(client, url, event, prompt=p, max_tokens=CONTEXT - 20, temperature=0))
                    for p, event in zip(PROMPTS, started)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=120)
            arrived = time.perf_counter()  # all four are decoding now
            short = await stream(client, url, prompt=PROMPTS[4], max_tokens=4, temperature=0)
            return arrived, short, await asyncio.gather(*long)

    with serving(run_dir, max_active=8) as (url, _):
        arrived, short, long = asyncio.run(main(url))
    # Admitted at the next iteration of the shared loop: its tokens come while the others still decode.
    assert arrived < short["first"] <= short["last"] < min(r["last"] for r in long)
    assert all(r["usage"]["completion_tokens"] == CONTEXT - 20 for r in long)


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_seeded_sampling_is_the_same_alone_or_under_load_and_matches_load_model(run_dir, model):
    sampling = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 24}
    expected = text_of(sampled_ids(model, "import ", 24, 0.9, 0.95, seed=7))

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            alone = await complete(client, url, prompt="import ", seed=7, **sampling)
            crowd = await asyncio.gather(
                complete(client, url, prompt="import ", seed=7, **sampling),
                *(complete(client, url, prompt=p, seed=i, **sampling) for i, p in enumerate(PROMPTS[:8])),
                complete(client, url, prompt="import ", seed=8, **sampling))
        return alone, crowd

    with serving(run_dir, max_active=16) as (url, _):
        alone, crowd = asyncio.run(main(url))
    assert alone["choices"][0]["text"] == expected
    assert crowd[0]["choices"][0]["text"] == expected
    assert crowd[-1]["choices"][0]["text"] != expected  # another seed, another sample


def test_top_p_and_temperature_draw_from_the_nucleus_only():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    generator = torch.Generator().manual_seed(0)
    assert {_draw(logits, 1.0, 0.7, generator) for _ in range(300)} == {0, 1}
    assert {_draw(logits, 1.0, 0.85, generator) for _ in range(300)} == {0, 1, 2}
    assert {_draw(logits, 1.0, 1.0, generator) for _ in range(600)} == {0, 1, 2, 3}
    even = torch.zeros(4)  # the smallest set that holds top_p: 2 of 4 equal tokens hold 0.5 (not 3)
    assert len({_draw(even, 1.0, 0.5, generator) for _ in range(300)}) == 2
    cold = [_draw(logits, 0.05, 1.0, generator) for _ in range(300)]
    assert cold.count(0) > 290  # a low temperature is nearly greedy


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_stop_strings_end_the_completion_before_the_first_one(run_dir, model):
    full = text_of(greedy_ids(model, "with open(", 40))
    # A stop string that first occurs after the first character, so that text comes before it (a string
    # picked at a fixed offset may occur at the start of what this run's model writes)
    cut = next(start for start in range(1, len(full) - 3) if full.find(full[start:start + 3]) == start)
    stop = full[cut:cut + 3]

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            plain = await complete(client, url, prompt="with open(", max_tokens=40, temperature=0, stop=[stop, "\x01"])
            streamed = await stream(client, url, prompt="with open(", max_tokens=40, temperature=0, stop=stop)
        return plain, streamed

    with serving(run_dir) as (url, _):
        plain, streamed = asyncio.run(main(url))
    assert plain["choices"][0]["text"] == full[:cut] and plain["choices"][0]["finish_reason"] == "stop"
    assert streamed["text"] == full[:cut] and streamed["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] < 40


# -- request rules, back-pressure, cancellation, health -------------------------------------------------

BAD_REQUESTS = [
    ('{"prompt": "x", "max_tokens": 4', "body", "not valid JSON"),
    ('["x"]', "body", "must be a JSON object"),
    ('{"max_tokens": 4}', "prompt", "prompt is required"),
    ('{"prompt": 7}', "prompt", "must be a string"),
    ('{"prompt": ""}', "prompt", "empty"),
    ('{"prompt": "ab\\udc80"}', "prompt", "prompt is not valid Unicode text: surrogates not allowed '\\udc80'"),
    ('{"prompt": "' + "x" * 70 + '"}', "prompt", "longer than the model's context of 64"),
    ('{"prompt": "' + "x" * 1000 + '"}', "prompt", "prompt: 1000 characters, at least 500 tokens, more than the model's"),
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens", "must be an integer >= 1"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens", "must be an integer >= 1"),
    ('{"prompt": "x", "max_tokens": 4.5}', "max_tokens", "must be an integer >= 1"),
    ('{"prompt": "x", "max_tokens": 100000}', "max_tokens", "must be <= 63"),
    ('{"prompt": "x", "temperature": -0.5}', "temperature", "in [0, 2]"),
    ('{"prompt": "x", "temperature": "hot"}', "temperature", "in [0, 2]"),
    ('{"prompt": "x", "top_p": 0}', "top_p", "in (0, 1]"),
    ('{"prompt": "x", "top_p": 1.5}', "top_p", "in (0, 1]"),
    ('{"prompt": "x", "seed": -3}', "seed", "integer in [0,"),
    ('{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop", "at most 4"),
    ('{"prompt": "x", "stop": [""]}', "stop", "non-empty"),
    ('{"prompt": "x", "stream": "yes"}', "stream", "true or false"),
    ('{"prompt": "x", "n": 2}', "n", "must be 1"),
    ('{"prompt": "x", "n": true}', "n", "n=True must be 1"),
    ('{"prompt": "x", "n": 1.0}', "n", "n=1.0 must be 1"),
    ('{"prompt": "x", "max_token": 4}', "max_token", "unknown field"),
    ("[" * 2_000_000 + "]" * 2_000_000, "body", "nests arrays or objects too deeply"),  # 4 MB: json.loads recurses
    ('{"prompt": "x", "stop": ' + '{"a": ' * 500_000 + "0" + "}" * 500_001, "body", "nests arrays or objects too deeply"),
]


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_every_bad_request_gets_a_400_naming_the_field_and_the_rule(run_dir):
    async def main(url):
        async with httpx.AsyncClient(timeout=30) as client:
            return [await client.post(url + "/v1/completions", content=body,
                                      headers={"content-type": "application/json"}) for body, _, _ in BAD_REQUESTS]

    with serving(run_dir) as (url, generator):
        responses = asyncio.run(main(url))
        assert generator.in_flight == 0
    for (body, field, rule), response in zip(BAD_REQUESTS, responses):
        assert response.status_code == 400, (body, response.status_code, response.text)
        error = response.json()["error"]
        assert error["param"] == field and rule in error["message"], (body, error)


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_full_server_answers_429_and_serves_again_once_requests_finish(run_dir):
    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            first = [asyncio.ensure_future(stream(client, url, prompt=p, max_tokens=CONTEXT - 20, temperature=0))
                     for p in PROMPTS[:2]]
            while generator.in_flight < 2:
                await asyncio.sleep(0.005)
            refused = await client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            served = await asyncio.gather(*first)
            again = await client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return refused, served, again

    with serving(run_dir, max_active=1, max_queue=1) as (url, generator):
        refused, served, again = asyncio.run(main(url))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "max_active=1 + max_queue=1" in refused.json()["error"]["message"]
    assert all(r["usage"]["completion_tokens"] == CONTEXT - 20 for r in served)
    assert again.status_code == 200


def _spy_on_cancellations(generator) -> list[str]:
    manager, cancelled = generator._manager, []
    original = manager.cancel_request
    manager.cancel_request = lambda request_id: (cancelled.append(request_id), original(request_id))[1]
    return cancelled


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_client_that_disconnects_cancels_its_request(run_dir, caplog):
    body = json.dumps({"prompt": "def __init__(self", "max_tokens": CONTEXT - 20, "temperature": 0})

    async def stream_then_leave(url):
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", url + "/v1/completions",
                                     json={**json.loads(body), "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # one chunk, then hang up

    def wait_for(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.002)

    with serving(run_dir, max_active=4) as (url, generator):
        cancelled = _spy_on_cancellations(generator)
        asyncio.run(stream_then_leave(url))
        wait_for(lambda: len(cancelled) == 1 and not generator.in_flight)
        assert len(cancelled) == 1 and generator.in_flight == 0
        # Non-streaming: send the request and close the socket without reading the answer.
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            wait_for(lambda: generator.in_flight)  # it is decoding
        wait_for(lambda: len(cancelled) == 2 and not generator.in_flight)
        assert len(cancelled) == 2 and generator.in_flight == 0
        # Mid-body: the headers promise more than is sent before the socket closes.
        uvicorn_errors = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to the root
        uvicorn_errors.addHandler(caplog.handler)
        with caplog.at_level("INFO", logger="ddptrain"):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body) + 50}\r\n\r\n{body[:5]}".encode())
            wait_for(lambda: "disconnected before sending its whole request" in caplog.text)
        uvicorn_errors.removeHandler(caplog.handler)
        assert "disconnected before sending its whole request" in caplog.text
        assert not [r for r in caplog.records if r.levelname == "ERROR"], "a disconnect is no ERROR with a traceback"
        assert httpx.get(url + "/health").json()["status"] == "ok"


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_hundreds_of_requests_with_random_cancellations_leave_the_server_healthy(run_dir, model):
    rng = random.Random(0)
    expected = text_of(greedy_ids(model, "class Foo", 16))

    async def one(client, url, index):
        prompt, tokens = PROMPTS[index % len(PROMPTS)], rng.randrange(1, 24)
        request = asyncio.ensure_future(
            stream(client, url, prompt=prompt, max_tokens=tokens, temperature=rng.choice([0, 0.8]))
            if index % 2 else complete(client, url, prompt=prompt, max_tokens=tokens, seed=index))
        if rng.random() < 0.4:  # hang up after a moment
            await asyncio.sleep(rng.uniform(0, 0.05))
            request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request

    async def main(url):
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
            for batch in range(0, 300, 30):
                await asyncio.gather(*(one(client, url, index) for index in range(batch, batch + 30)))
            return await complete(client, url, prompt="class Foo", max_tokens=16, temperature=0)

    with serving(run_dir, max_active=8, max_queue=64) as (url, generator):
        after = asyncio.run(main(url))
        deadline = time.monotonic() + 10
        while generator.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["in_flight"] == 0
    assert after["choices"][0]["text"] == expected


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_health_is_503_once_the_decoding_loop_is_gone(run_dir):
    with serving(run_dir) as (url, generator):
        assert httpx.get(url + "/health").json()["status"] == "ok"
        generator._manager.stop(block=True, timeout=10)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503


# -- chat completions: the model's chat template, the same rules and the same batch --------------------


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_chat_completions_continue_the_rendered_chat_as_load_model_does(chat_dir, model):
    lengths = [6 + 3 * i for i in range(len(CHATS))]
    expected = [text_of(greedy_ids(model, rendered(messages), n)) for messages, n in zip(CHATS, lengths)]
    assert len(set(expected)) > 1  # the conversations really lead to different answers
    default_room = CONTEXT - len(rendered(CHATS[2]).encode())
    sampled = text_of(sampled_ids(model, rendered(CHATS[1]), 12, 0.9, 0.95, seed=7))

    async def main(url):
        async with httpx.AsyncClient(timeout=60) as client:
            together = await asyncio.gather(*(chat(client, url, messages=m, max_tokens=n, temperature=0)
                                              for m, n in zip(CHATS, lengths)))
            alone = [await chat(client, url, model="m", messages=m, max_completion_tokens=n, temperature=0)
                     for m, n in zip(CHATS, lengths)]
            streamed = await asyncio.gather(*(chat_stream(client, url, messages=m, max_tokens=n, temperature=0)
                                              for m, n in zip(CHATS, lengths)))
            # OpenAI's chat default: no max_tokens continues to the end of the context.
            to_the_end = await chat(client, url, messages=CHATS[2], temperature=0)
            seeded = await asyncio.gather(
                chat(client, url, messages=CHATS[1], max_tokens=12, temperature=0.9, top_p=0.95, seed=7),
                *(chat(client, url, messages=m, max_tokens=6, temperature=0.9, seed=i) for i, m in enumerate(CHATS)))
            completion = await complete(client, url, prompt=rendered(CHATS[2]), max_tokens=lengths[2], temperature=0)
        return together, alone, streamed, to_the_end, seeded[0], completion

    with serving(chat_dir, max_active=8) as (url, generator):
        together, alone, streamed, to_the_end, seeded, completion = asyncio.run(main(url))
        assert generator.in_flight == 0
    assert [r["choices"][0]["message"]["content"] for r in together] == expected
    assert [r["choices"][0]["message"]["content"] for r in alone] == expected
    assert [r["text"] for r in streamed] == expected
    assert [r["usage"] for r in together] == [
        {"prompt_tokens": len(rendered(m).encode()), "completion_tokens": n,
         "total_tokens": len(rendered(m).encode()) + n} for m, n in zip(CHATS, lengths)]
    assert {r["choices"][0]["finish_reason"] for r in together} == {"length"}
    assert completion["choices"][0]["text"] == expected[2]  # the chat is its rendering sent as a prompt
    # The stream as OpenAI's: the assistant's role first, text deltas, then finish_reason and usage.
    for result, tokens in zip(streamed, lengths):
        first, *middle, last = result["chunks"]
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None
                   for c in middle)
        assert last["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}
        assert last["usage"]["completion_tokens"] == tokens
        assert len({c["id"] for c in result["chunks"]}) == 1
    assert to_the_end["usage"]["completion_tokens"] == default_room
    assert to_the_end["choices"][0]["message"]["content"] == text_of(greedy_ids(model, rendered(CHATS[2]),
                                                                                default_room))
    assert seeded["choices"][0]["message"]["content"] == sampled


def test_control_tokens_typed_in_a_message_are_text_only_the_template_writes_them(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from ddptrain.serving.messages import ChatTemplate

    template = "{% for message in messages %}{{ message['content'] + '<|end|>' }}{% endfor %}"
    PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), chat_template=template,
                            additional_special_tokens=["<|end|>"]).save_pretrained(tmp_path)
    end = 256  # the added token's id
    assert ChatTemplate.load(tmp_path).render([{"role": "user", "content": "a<|end|>b"}]) == [*b"a<|end|>b", end]


HI = [{"role": "user", "content": "hi"}]
HI_ROOM = CONTEXT - len(rendered(HI).encode())
BAD_CHAT_REQUESTS = [
    ('{"messages": [', "body", "not valid JSON"),
    ({"max_tokens": 4}, "messages", "messages is required"),
    ({"messages": []}, "messages", "must be a non-empty list of {role, content} objects, not []"),
    ({"messages": "hi"}, "messages", "must be a non-empty list of {role, content} objects, not str"),
    ({"messages": ["hi"]}, "messages[0]", "messages[0] must be an object with role and content, not str"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "messages[0].role is required"),
    ({"messages": [*HI, {"role": "user"}]}, "messages[1].content", "messages[1].content is required"),
    ({"messages": [*HI, {"role": "robot", "content": "b"}]}, "messages[1].role",
     "messages[1].role='robot' must be one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "must be a string, not int"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "must be a string, not NoneType"),
    ({"messages": [{"role": "user", "content": "ab\udc80"}]}, "messages[0].content", "is not valid Unicode text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "messages[0].content",
     "content parts"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name", "unknown key 'name'"),
    ({"messages": [{"role": "user", "content": "x" * 60}]}, "messages",
     "rendered chat is 84 tokens, longer than the model's context of 64"),
    ({"messages": [*HI, {"role": "system", "content": "b"}]}, "messages",
     "the model's chat template refused the messages: a system message must come first"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens", "max_tokens=0 must be an integer >= 1"),
    ({"messages": HI, "max_tokens": 100}, "max_tokens",
     f"max_tokens=100 with a rendered chat of {64 - HI_ROOM} tokens exceeds the model's context of 64 positions; "
     f"max_tokens must be <= {HI_ROOM}"),
    ({"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens=0 must be an integer >= 1"),
    ({"messages": HI, "max_completion_tokens": 100}, "max_completion_tokens",
     f"max_completion_tokens must be <= {HI_ROOM}"),
    ({"messages": HI, "max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens",
     "max_completion_tokens=5 and max_tokens=4 differ"),
    ({"messages": HI, "temperature": -0.5}, "temperature", "in [0, 2]"),
    ({"messages": HI, "top_p": 0}, "top_p", "in (0, 1]"),
    ({"messages": HI, "seed": -3}, "seed", "integer in [0,"),
    ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"messages": HI, "stream": "yes"}, "stream", "true or false"),
    ({"messages": HI, "n": 2}, "n", "must be 1"),
    ({"messages": HI, "n": True}, "n", "n=True must be 1"),
    ({"messages": HI, "n": 1.0}, "n", "n=1.0 must be 1"),
    ({"messages": [{"role": "user", "content": "x" * 1000}]}, "messages",
     "at least 500 tokens, more than the model's context of 64"),
    ({"messages": HI, "prompt": "x"}, "prompt", "unknown field 'prompt'"),
]


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_every_bad_chat_request_gets_a_400_naming_the_field_and_the_rule(chat_dir, run_dir):
    async def post_all(url, requests):
        async with httpx.AsyncClient(timeout=30) as client:
            return [await client.post(url + "/v1/chat/completions", headers={"content-type": "application/json"},
                                      content=body if isinstance(body, str) else json.dumps(body))
                    for body in requests]

    with serving(chat_dir) as (url, generator):
        responses = asyncio.run(post_all(url, [body for body, _, _ in BAD_CHAT_REQUESTS]))
        assert generator.in_flight == 0
    for (body, field, rule), response in zip(BAD_CHAT_REQUESTS, responses):
        assert response.status_code == 400, (body, response.status_code, response.text)
        error = response.json()["error"]
        assert error == {"message": error["message"], "type": "invalid_request_error", "param": field, "code": 400}
        assert rule in error["message"], (body, error)
    # A model without a chat template serves completions; a chat request is a 400 that says why.
    with serving(run_dir) as (url, _):
        [refused] = asyncio.run(post_all(url, [{"messages": HI}]))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert "the served model has no chat template" in refused.json()["error"]["message"]


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_20_mb_request_gets_its_400_at_once_and_does_not_slow_the_small_ones(chat_dir):
    """The body's size is checked before it is read, and rendering and tokenizing run off the event
    loop: a huge request neither waits for its refusal nor holds up the others. Asserted by what
    happens, never by how fast (a latency ratio fails on a loaded machine; the figures:
    `python -m benchmarks.bench_serve --huge-request-mb 20`): a request that declares 20 MB and has
    sent 64 KiB gets its 400 with the rest never sent, so the server waited for none of it; small
    requests are answered while that connection is still open, and beside a 20 MB body sent whole."""
    small = {"messages": HI, "max_tokens": 4, "temperature": 0}
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 20_000_000}], "max_tokens": 4}).encode()

    async def small_ones(client, url, count: int) -> list[int]:
        return [(await client.post(url + "/v1/chat/completions", json=small)).status_code for _ in range(count)]

    async def refused_unsent(url) -> tuple[str, bytes, asyncio.StreamWriter]:
        """Headers declaring the whole body, 64 KiB of it (socket buffers take that whether or not the
        server reads), then the answer: it comes with the rest of the 20 MB unsent."""
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(huge)}\r\n\r\n".encode() + huge[: 2**16])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=120)  # a hang guard, not a bound
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        return head.decode().split("\r\n")[0], await asyncio.wait_for(reader.readexactly(length), timeout=120), writer

    async def main(url):
        async with httpx.AsyncClient(timeout=120) as client, httpx.AsyncClient(timeout=120) as other:
            status_line, refusal, open_request = await refused_unsent(url)
            while_open = await small_ones(client, url, 4)  # the refused request's connection is still open
            open_request.close()
            beside, whole = await asyncio.gather(
                small_ones(client, url, 12), other.post(url + "/v1/chat/completions", content=huge,
                                                        headers={"content-type": "application/json"}))
            health = await client.get(url + "/health")
        return status_line, refusal.decode(), while_open, beside, whole, health.status_code

    with serving(chat_dir) as (url, generator):
        status_line, refusal, while_open, beside, whole, health = asyncio.run(main(url))
        assert generator.in_flight == 0
    assert status_line.split()[1] == "400", status_line
    assert json.loads(refusal)["error"]["param"] == "body" and "MiB" in refusal, refusal
    assert while_open == [200] * 4 and beside == [200] * 12
    assert whole.status_code == 400 and "request body" in whole.text and "MiB" in whole.text, whole.text[:500]
    assert health == 200


# -- the command-line tools ---------------------------------------------------------------------------


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_generate_cli_continues_prompts_like_load_model_and_refuses_what_does_not_fit(run_dir, model, capsys):
    command = [*launch_command(["-m", "ddptrain.generate"]), str(run_dir), "--prompt", "import ", "--prompt", "class Foo",
               "--max-tokens", "20", "--temperature", "0"]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    samples = [prompt + text_of(greedy_ids(model, prompt, 20)) for prompt in ("import ", "class Foo")]
    assert result.stdout.endswith(f"{samples[0]}\n{SEPARATOR}\n{samples[1]}\n"), result.stdout
    from ddptrain.generate import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(run_dir), "--prompt", "x" * 70])
    assert exit_info.value.code == 2 and "longer than the model's context of 64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(run_dir), "--prompt", "ab\udcffcd"])  # $'ab\xffcd' on a command line, as Python decodes argv
    assert exit_info.value.code == 2 and "--prompt is not valid Unicode text" in capsys.readouterr().err


@contextlib.contextmanager
def serve_cli(path, log):
    """`python -m ddptrain.serve PATH --port P` in a subprocess, its output in `log`; yields its URL once
    /health answers, and terminates it after."""
    port, output = free_port(), open(log, "w+")
    process = subprocess.Popen([*launch_command(["-m", "ddptrain.serve"]), str(path), "--port", str(port)],
                               cwd=REPO, env=_env(), stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600  # a hang guard: the server starts in seconds
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        output.close()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: exit status -SIGTERM, not a kill.
    assert process.returncode == -signal.SIGTERM


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_serve_cli_serves_a_run_directory(run_dir, model, tmp_path):
    with serve_cli(run_dir, tmp_path / "serve.log") as url:
        answer = httpx.post(url + "/v1/completions", timeout=30,
                            json={"prompt": "import ", "max_tokens": 12, "temperature": 0}).json()
    assert answer["choices"][0]["text"] == text_of(greedy_ids(model, "import ", 12))
    # The byte tokenizer has no chat template: said at start-up (chat requests are 400s that say it too).
    assert "the served model has no chat template" in (tmp_path / "serve.log").read_text()


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_serve_cli_answers_chat_with_the_models_template(chat_dir, model, tmp_path):
    messages = [{"role": "user", "content": "def main("}]
    with serve_cli(chat_dir, tmp_path / "serve.log") as url:
        answer = httpx.post(url + "/v1/chat/completions", timeout=30,
                            json={"messages": messages, "max_tokens": 12, "temperature": 0}).json()
    assert answer["choices"][0]["message"] == {"role": "assistant",
                                               "content": text_of(greedy_ids(model, rendered(messages), 12))}
    assert "/v1/chat/completions answers 400" not in (tmp_path / "serve.log").read_text()


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_serve_cli_refuses_a_directory_it_cannot_serve(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a transformers directory without tokenizer.json
    result = subprocess.run([*launch_command(["-m", "ddptrain.serve"]), str(tmp_path)], cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "has no tokenizer.json" in result.stderr


def test_sampling_params_state_the_rule():
    with pytest.raises(ValueError, match=r"temperature=2.5 must be a number in \[0, 2\]"):
        SamplingParams(temperature=2.5)
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_bad_device_and_cache_flags_are_clear_errors(run_dir, capsys):
    from ddptrain.generate import main as generate_main
    from ddptrain.serving.server import main as serve_main

    bad = [(generate_main, ["--prompt", "x", "--device", "nonsense"], "--device='nonsense' is not a device"),
           (serve_main, ["--device", "nonsense"], "--device='nonsense' is not a device"),
           (serve_main, ["--kv-cache-mb", "-1"], "kv_cache_mb=-1.0 must be a finite number of MiB > 0")]
    if not torch.cuda.is_available():
        bad.append((generate_main, ["--prompt", "x", "--device", "cuda"], "--device='cuda': this machine has 0 CUDA"))
    for main, flags, message in bad:
        with pytest.raises(SystemExit) as exit_info:
            main([str(run_dir), *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags

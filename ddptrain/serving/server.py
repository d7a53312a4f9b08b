"""`python -m ddptrain.serve RUN_DIR|MODEL_DIR`: an OpenAI-style completions server with continuous batching.

    POST /v1/completions       prompt, max_tokens, temperature, top_p, seed, stop, stream (server-sent events)
    POST /v1/chat/completions  messages (rendered with the model's chat template), the same fields
    GET  /health               200 {"status": "ok", ...} while the decoding loop runs, else 503
    GET  /v1/models            the one model served

The decoding loop is transformers' continuous batching (ddptrain.generation.generator.Generator) and the HTTP
stack is the one `transformers serve` uses (FastAPI on uvicorn, the `transformers[serving]`
extra); transformers' own server is not used because, with --continuous-batching, it keeps the
first request's temperature and top_p for every later request, ignores `stop`, answers
max_tokens=-1 with 200, a prompt longer than the context with 500 and malformed JSON with 422
(measured with transformers 5.24; docs/serving.md has the whole comparison). Here every field is
checked (a 400 names the field and the rule), sampling is per request, at most max_active +
max_queue requests are in flight (more get 429), a body over --max-request-mb is a 400 unread, a
prompt is parsed, rendered and tokenized off the event loop, and a request whose client disconnects
stops decoding at the next iteration. Both endpoints share the rules, the queue and the batch; they
differ in the prompt (text, or messages through ddptrain.serving.messages) and the objects they answer with.
"""

# No `from __future__ import annotations`: FastAPI reads the route's `request: Request` annotation at
# run time, and Request is imported inside build_app (FastAPI is an optional extra).

import argparse
import asyncio
import contextlib
import json
import logging
import re
import sys
import time
from pathlib import Path

from ddptrain.generation.generator import (Completion, GenerationError, Generator, QueueFull, RequestError,
                                           SamplingParams, quiet_transformers)
from ddptrain.serving.access import API_KEY_ENV, AccessError, RequireApiKey, describe_access, resolve_api_key
from ddptrain.serving.messages import RENDERED, ChatBodies, ChatTemplate, check_messages

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop")
ACCEPTED_FIELDS = ("prompt", "stream", "model", "n", "user", *SAMPLING_FIELDS)
"""Fields of OpenAI's completion request this server takes; any other is a 400 (not silently ignored)."""
CHAT_FIELDS = ("messages", "stream", "model", "n", "user", "max_completion_tokens", *SAMPLING_FIELDS)
"""Fields of OpenAI's chat completion request this server takes (max_completion_tokens: max_tokens' newer name)."""
MAX_REQUEST_BYTES = 8 * 2**20
"""The default bound on a request body (--max-request-mb): a context of 128k tokens is about 0.5 MiB of text."""


def _read_body(raw: bytes, accepted: tuple[str, ...]) -> dict:
    """The request body as a dict with the rules both endpoints share, or RequestError naming the field."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError("body", f"the request body is not valid JSON: {error}") from None
    except RecursionError:  # json's decoder recurses once per nested array or object
        raise RequestError("body", "the request body nests arrays or objects too deeply to parse; no field of "
                                   "a request nests more than a few levels") from None
    if not isinstance(body, dict):
        raise RequestError("body", f"the request body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - set(accepted))
    if unknown:
        raise RequestError(unknown[0], f"unknown field {unknown[0]!r}; this server accepts {', '.join(accepted)}")
    if "n" in body and (type(body["n"]) is not int or body["n"] != 1):  # True == 1.0 == 1 in Python
        raise RequestError("n", f"n={body['n']!r} must be 1 (one completion per request)")
    if not isinstance(body.get("stream", False), bool):
        raise RequestError("stream", f"stream={body['stream']!r} must be true or false")
    return body


def _sampling_fields(body: dict) -> dict:
    return {key: body[key] for key in SAMPLING_FIELDS if key in body and body[key] is not None}


def parse_completion_request(raw: bytes) -> tuple[str, SamplingParams, bool]:
    """(prompt, sampling, stream) of a request body, or RequestError naming the field and the rule."""
    body = _read_body(raw, ACCEPTED_FIELDS)
    if "prompt" not in body:
        raise RequestError("prompt", "prompt is required (a string)")
    return body["prompt"], SamplingParams(**_sampling_fields(body)), body.get("stream", False)


def parse_chat_request(raw: bytes) -> tuple[list[dict], dict, bool]:
    """(messages, the sampling fields set, stream) of a chat request body, or RequestError naming the
    field and the rule. The fields become SamplingParams once the prompt's length is known (`chat_params`)."""
    body = _read_body(raw, CHAT_FIELDS)
    if "messages" not in body:
        raise RequestError("messages", "messages is required (a list of {role, content} objects)")
    messages = check_messages(body["messages"])
    fields = _sampling_fields(body)
    newer = body.get("max_completion_tokens")
    if newer is not None:
        older = fields.pop("max_tokens", newer)
        if older != newer:
            raise RequestError("max_completion_tokens", f"max_completion_tokens={newer!r} and max_tokens={older!r} "
                                                        "differ; send one (max_tokens is its older name)")
        fields["max_completion_tokens"] = newer
    return messages, fields, body.get("stream", False)


def chat_params(generator: Generator, prompt_ids: list[int], fields: dict) -> SamplingParams:
    """The sampling of a chat request whose rendered prompt is `prompt_ids`, or RequestError. As in
    OpenAI's chat API, without max_tokens it may continue to the end of the context (16 tokens where
    the context is unknown)."""
    generator.check_fits(prompt_ids, None, "messages", RENDERED)
    named = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    fields = dict(fields)
    if named in fields:
        fields["max_tokens"] = fields.pop(named)
    elif generator.room(prompt_ids) is not None:
        fields["max_tokens"] = generator.room(prompt_ids)
    try:
        params = SamplingParams(**fields)
        generator.check_fits(prompt_ids, params, "messages", RENDERED)
    except RequestError as error:
        if error.field == "max_tokens" and named != "max_tokens":  # said with the name the client used
            raise RequestError(named, re.sub(r"\bmax_tokens\b", named, str(error))) from None
        raise
    return params


def check_text_fits(generator: Generator, texts: list[str], field: str) -> None:
    """A RequestError when `texts` cannot fit the context whatever the template or tokenizer makes
    of them: each token covers at most the characters of the vocabulary's longest token, so they
    are at least (characters / that) tokens, halved for normalization that joins characters. Cheap,
    so a huge request is refused before it is rendered or tokenized."""
    if generator.context is None:
        return
    characters = sum(len(text) for text in texts if isinstance(text, str))  # others: a 400 of their own later
    at_least = characters // (2 * generator.longest_token_chars)
    if at_least > generator.context:
        raise RequestError(field, f"{field}: {characters} characters, at least {at_least} tokens, more than the "
                                  f"model's context of {generator.context} positions")


def _error(status: int, message: str, field: str | None = None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": field, "code": status}},
                        status_code=status, headers={"Retry-After": "1"} if status in (429, 503) else None)


class TextBodies:
    """OpenAI's text_completion answer and its stream: one chunk per text piece, a last one with
    finish_reason and usage."""

    def __init__(self, model: str):
        self.model = model

    def _body(self, completion: Completion, text: str, finish_reason: str | None) -> dict:
        return {"id": completion.id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}

    def answer(self, completion: Completion, text: str) -> dict:
        return {**self._body(completion, text, completion.finish_reason), "usage": completion.usage}

    def opening(self, completion: Completion) -> list[dict]:
        return []

    def chunk(self, completion: Completion, piece: str, finish_reason: str | None) -> dict:
        body = self._body(completion, piece, finish_reason)
        return body if finish_reason is None else {**body, "usage": completion.usage}


async def _wait_for_disconnect(request) -> None:
    """Returns when the client goes away (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(generator: Generator, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES):
    """The FastAPI app; its lifespan starts the generator's decoding loop and closes it. With
    `api_key`, every endpoint but /health requires it (ddptrain/serving/access.py). A request body
    over `max_request_bytes` is a 400, unread."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    @contextlib.asynccontextmanager
    async def lifespan(app):
        generator.start()
        try:
            yield
        finally:
            generator.close()

    app = FastAPI(title="ddptrain serve", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.state.generator = generator
    model = generator.model_name

    @app.get("/health")
    async def health():
        is_healthy = generator.is_healthy()
        body = {"status": "ok" if is_healthy else "unhealthy", "model": model, "in_flight": generator.in_flight,
                "max_active": generator.max_active, "max_queue": generator.max_queue, "context": generator.context}
        return JSONResponse(body, status_code=200 if is_healthy else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "ddptrain"}]}

    chat_template = ChatTemplate.load(generator.model_dir)
    if not chat_template.is_available:  # completions still work; chat requests get a 400 that says this
        log.warning("%s: /v1/chat/completions answers 400", chat_template.unavailable)
    app.state.chat_template = chat_template
    text_bodies, chat_bodies = TextBodies(model), ChatBodies(model)

    async def body_of(request: Request):
        """The request body (bytes), or the response that ends the request: a 400 for a body over
        max_request_bytes, refused by its Content-Length before any of it is read (or as soon as a
        chunked one passes it); a 499 when the client went away before sending all of it (nobody
        to answer: an info line, not an ERROR with a traceback per disconnect)."""
        too_large = _error(400, f"the request body is larger than this server's limit of {max_request_bytes} bytes "
                                f"({max_request_bytes / 2**20:.1f} MiB; python -m ddptrain.serve --max-request-mb)",
                           "body")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            return too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_request_bytes:
                    return too_large
                chunks.append(chunk)
        except ClientDisconnect:
            log.info("client %s disconnected before sending its whole request", request.client)
            return Response(status_code=499)
        return b"".join(chunks)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        if not isinstance(body, bytes):
            return body

        def prepare():
            prompt, params, stream = parse_completion_request(body)
            check_text_fits(generator, [prompt], "prompt")
            return generator.prepare(prompt, params), params, stream

        try:  # parsing and tokenizing off the event loop: a large request holds up no other
            prompt_ids, params, stream = await asyncio.to_thread(prepare)
        except RequestError as error:
            return _error(400, str(error), error.field)
        return await _answer(request, generator, prompt_ids, params, stream, text_bodies)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        if not isinstance(body, bytes):
            return body

        def prepare():
            messages, fields, stream = parse_chat_request(body)
            check_text_fits(generator, [message["content"] for message in messages], "messages")
            prompt_ids = chat_template.render(messages)
            return prompt_ids, chat_params(generator, prompt_ids, fields), stream

        try:  # parsing, rendering and tokenizing off the event loop: a large request holds up no other
            prompt_ids, params, stream = await asyncio.to_thread(prepare)
        except RequestError as error:
            return _error(400, str(error), error.field)
        return await _answer(request, generator, prompt_ids, params, stream, chat_bodies)

    return app


async def _answer(request, generator: Generator, prompt_ids: list[int], params: SamplingParams, stream: bool,
                  bodies: TextBodies | ChatBodies):
    """Submit the request to the running batch; its answer (or stream) in the objects of `bodies`."""
    from fastapi.responses import StreamingResponse

    try:
        completion = generator.submit(prompt_ids, params, stream=stream)
    except QueueFull as error:
        return _error(429, f"server busy: {error}; retry later", kind="rate_limit_error")
    except GenerationError as error:
        return _error(503, str(error), kind="server_error")
    if stream:
        return StreamingResponse(_events(completion, bodies), media_type="text/event-stream")
    return await _complete(request, completion, bodies)


async def _complete(request, completion: Completion, bodies: TextBodies | ChatBodies):
    from fastapi.responses import JSONResponse, Response

    text = asyncio.ensure_future(completion.text())
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({text, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not text.done():  # the client went away: stop decoding for nobody
            text.cancel()
            completion.cancel()
    if not text.done() or text.cancelled():
        return Response(status_code=499)  # nobody reads it
    try:
        body = bodies.answer(completion, text.result())
    except GenerationError as error:
        return _error(500, str(error), kind="server_error")
    return JSONResponse(body)


async def _events(completion: Completion, bodies: TextBodies | ChatBodies):
    """Server-sent events as OpenAI streams them: text chunks, a last chunk with the finish reason
    and usage, then `data: [DONE]`. A client that disconnects cancels the stream, and the request."""
    try:
        for chunk in bodies.opening(completion):
            yield f"data: {json.dumps(chunk)}\n\n"
        async for piece in completion.deltas():
            yield f"data: {json.dumps(bodies.chunk(completion, piece, None))}\n\n"
        yield f"data: {json.dumps(bodies.chunk(completion, '', completion.finish_reason))}\n\n"
    except GenerationError as error:
        yield f"data: {json.dumps({'error': {'message': str(error), 'type': 'server_error', 'code': 500}})}\n\n"
    finally:
        completion.cancel()
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.serve",
                                     description="Serve a trained model over HTTP (OpenAI-style /v1/completions and "
                                                 "/v1/chat/completions) "
                                                 "with continuous batching.")
    parser.add_argument("path", type=Path, help="a ddptrain run directory or a transformers model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--max-active", type=int, default=32, help="sequences decoded together (default: 32)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting beyond those; more get 429 (default: 256)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--kv-cache-mb", type=float, default=1024.0, help="KV cache bound in MiB (default: 1024)")
    parser.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_BYTES / 2**20,
                        help="a request body over this many MiB is a 400, unread (default: 8)")
    parser.add_argument("--api-key", default=None,
                        help=f"require Authorization: Bearer KEY on every endpoint but /health (or ${API_KEY_ENV})")
    parser.add_argument("--api-key-file", type=Path, default=None, help="read the API key from this file")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve a non-loopback --host without an API key")
    parser.add_argument("--which", choices=("final", "best"), default="final",
                        help="a run directory's final/ (default) or best/ weights (checkpoint.keep_best)")
    args = parser.parse_args(argv)
    if not 0 < args.max_request_mb < float("inf"):
        print(f"serve error: --max-request-mb={args.max_request_mb} must be a finite number of MiB > 0",
              file=sys.stderr)
        sys.exit(2)
    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
        access = describe_access(args.host, api_key, args.allow_unauthenticated)  # before loading any model
    except AccessError as error:
        print(f"serve error: {error}", file=sys.stderr)
        sys.exit(2)
    import uvicorn

    from ddptrain.serving.servable import ServableError, servable_dir

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    quiet_transformers()
    try:
        directory = servable_dir(args.path, args.which)
        generator = Generator(directory, max_active=args.max_active, max_queue=args.max_queue, device=args.device,
                              kv_cache_mb=args.kv_cache_mb)
    except (ServableError, FileNotFoundError, ValueError) as error:
        print(f"serve error: {error}", file=sys.stderr)
        sys.exit(2)
    log.info("serving %s (context %s tokens, %s) on http://%s:%d, %s", directory, generator.context, generator.device,
             args.host, args.port, access)
    app = build_app(generator, api_key, int(args.max_request_mb * 2**20))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()

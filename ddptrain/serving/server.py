"""`python -m ddptrain.serve RUN_DIR|MODEL_DIR`: an OpenAI-style completions server with continuous batching.

    POST /v1/completions   prompt, max_tokens, temperature, top_p, seed, stop, stream (server-sent events)
    GET  /health           200 {"status": "ok", ...} while the decoding loop runs, else 503
    GET  /v1/models        the one model served

The decoding loop is transformers' continuous batching (ddptrain.serving.generate.Generator) and the HTTP
stack is the one `transformers serve` uses (FastAPI on uvicorn, the `transformers[serving]`
extra); transformers' own server is not used because, with --continuous-batching, it keeps the
first request's temperature and top_p for every later request, ignores `stop`, answers
max_tokens=-1 with 200, a prompt longer than the context with 500 and malformed JSON with 422
(measured with transformers 5.24; docs/serving.md has the whole comparison). Here every field is
checked (a 400 names the field and the rule), sampling is per request, at most max_active +
max_queue requests are in flight (more get 429), and a request whose client disconnects stops
decoding at the next iteration.
"""

# No `from __future__ import annotations`: FastAPI reads the route's `request: Request` annotation at
# run time, and Request is imported inside build_app (FastAPI is an optional extra).

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from ddptrain.serving.generate import (Completion, GenerationError, Generator, QueueFull, RequestError, SamplingParams,
                               quiet_transformers)

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop")
ACCEPTED_FIELDS = ("prompt", "stream", "model", "n", "user", *SAMPLING_FIELDS)
"""Fields of OpenAI's completion request this server takes; any other is a 400 (not silently ignored)."""


def parse_completion_request(raw: bytes) -> tuple[str, SamplingParams, bool]:
    """(prompt, sampling, stream) of a request body, or RequestError naming the field and the rule."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError("body", f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("body", f"the request body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - set(ACCEPTED_FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unknown field {unknown[0]!r}; this server accepts "
                                       f"{', '.join(ACCEPTED_FIELDS)}")
    if "prompt" not in body:
        raise RequestError("prompt", "prompt is required (a string)")
    if body.get("n", 1) != 1:
        raise RequestError("n", f"n={body['n']!r} must be 1 (one completion per request)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", f"stream={stream!r} must be true or false")
    fields = {key: body[key] for key in SAMPLING_FIELDS if key in body and body[key] is not None}
    return body["prompt"], SamplingParams(**fields), stream


def _error(status: int, message: str, field: str | None = None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": field, "code": status}},
                        status_code=status, headers={"Retry-After": "1"} if status in (429, 503) else None)


def _completion_body(completion: Completion, model: str, text: str | None, finish_reason: str | None,
                     usage: bool) -> dict:
    body = {"id": completion.id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}]}
    if usage:
        body["usage"] = {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
                         "total_tokens": completion.prompt_tokens + completion.completion_tokens}
    return body


async def _wait_for_disconnect(request) -> None:
    """Returns when the client goes away (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(generator: Generator):
    """The FastAPI app; its lifespan starts the generator's decoding loop and closes it."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(app):
        generator.start()
        try:
            yield
        finally:
            generator.close()

    app = FastAPI(title="ddptrain serve", lifespan=lifespan)
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            prompt, params, stream = parse_completion_request(await request.body())
            prompt_ids = generator.prepare(prompt, params)
        except RequestError as error:
            return _error(400, str(error), error.field)
        try:
            completion = generator.submit(prompt_ids, params, stream=stream)
        except QueueFull as error:
            return _error(429, f"server busy: {error}; retry later", kind="rate_limit_error")
        except GenerationError as error:
            return _error(503, str(error), kind="server_error")
        if stream:
            return StreamingResponse(_events(completion, model), media_type="text/event-stream")
        return await _complete(request, completion, model)

    return app


async def _complete(request, completion: Completion, model: str):
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
        body = _completion_body(completion, model, text.result(), completion.finish_reason, usage=True)
    except GenerationError as error:
        return _error(500, str(error), kind="server_error")
    return JSONResponse(body)


async def _events(completion: Completion, model: str):
    """Server-sent events as OpenAI streams them: text chunks, a last chunk with the finish reason
    and usage, then `data: [DONE]`. A client that disconnects cancels the stream, and the request."""
    try:
        async for piece in completion.deltas():
            yield f"data: {json.dumps(_completion_body(completion, model, piece, None, usage=False))}\n\n"
        yield f"data: {json.dumps(_completion_body(completion, model, '', completion.finish_reason, usage=True))}\n\n"
    except GenerationError as error:
        yield f"data: {json.dumps({'error': {'message': str(error), 'type': 'server_error', 'code': 500}})}\n\n"
    finally:
        completion.cancel()
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.serve",
                                     description="Serve a trained model over HTTP (OpenAI-style /v1/completions) "
                                                 "with continuous batching.")
    parser.add_argument("path", type=Path, help="a ddptrain run directory or a transformers model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--max-active", type=int, default=32, help="sequences decoded together (default: 32)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting beyond those; more get 429 (default: 256)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--kv-cache-mb", type=float, default=1024.0, help="KV cache bound in MiB (default: 1024)")
    args = parser.parse_args(argv)
    import uvicorn

    from ddptrain.serving.servable import ServableError, servable_dir

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    quiet_transformers()
    try:
        directory = servable_dir(args.path)
        generator = Generator(directory, max_active=args.max_active, max_queue=args.max_queue, device=args.device,
                              kv_cache_mb=args.kv_cache_mb)
    except (ServableError, FileNotFoundError, ValueError) as error:
        print(f"serve error: {error}", file=sys.stderr)
        sys.exit(2)
    log.info("serving %s (context %s tokens, %s) on http://%s:%d", directory, generator.context, generator.device,
             args.host, args.port)
    uvicorn.run(build_app(generator), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()

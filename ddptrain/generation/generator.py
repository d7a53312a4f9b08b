"""Continuous-batching generation: the server's decoding loop and the RL rollouts' generator.

The scheduler, the paged KV cache and the decoding loop are transformers' own
(`ContinuousBatchingManager`): every active sequence takes one decoding loop, a new request
joins at the next iteration, and a finished one leaves at once. ddptrain adds what a server
and the rollouts need around it: request rules (`SamplingParams`, `Generator.prepare`), a bound on the
requests in flight (`QueueFull`), cancellation, stop strings, and per-request sampling.

Per-request sampling: transformers' manager draws every sampled token of a batch with one
`torch.multinomial`, and its HTTP server fixes temperature and top_p for the whole server from
the first request. `RequestSampler` (a continuous-batching logits processor) instead draws each
request's token from that request's own `torch.Generator` (seeded by `seed`) and leaves it as
the only finite score, so the manager's argmax takes it: a seeded request gives the same text
alone or among others. Greedy requests (temperature 0) are left untouched: they are the
manager's plain argmax.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import torch

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A request breaks a rule; `field` names the request field, the message the value and the rule."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def check_text(text: str, field_name: str) -> None:
    """RequestError unless `text` is valid Unicode (a lone surrogate, as JSON's "\\udc80" or a
    non-UTF-8 byte on a command line gives, cannot be encoded, so no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(field_name, f"{field_name} is not valid Unicode text: {error.reason} "
                                       f"{text[error.start]!r} at character {error.start}; send UTF-8 text") from None


class QueueFull(RuntimeError):
    """As many requests as the server holds are already in flight."""


class GenerationError(RuntimeError):
    """The decoding loop failed this request (or died)."""


class ModelLoadError(ValueError):
    """A model directory's weights cannot be read (truncated or damaged)."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt (OpenAI's completion fields and defaults)."""

    max_tokens: int = 16
    """Tokens to generate at most (>= 1; prompt + max_tokens must fit the model's context)."""
    temperature: float = 1.0
    """Softmax temperature in [0, 2]; 0 is greedy decoding (the most likely token every time)."""
    top_p: float = 1.0
    """Nucleus sampling in (0, 1]: draw from the smallest set of tokens holding this much probability."""
    seed: int | None = None
    """Seed of this request's own random generator (the same text alone or under load); None: random."""
    stop: tuple[str, ...] = ()
    """Up to 4 strings; the completion ends before the first one it produces."""

    def __post_init__(self):
        rules = (
            ("max_tokens", _is_integer(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_number(self.temperature) and 0 <= self.temperature <= 2, "a number in [0, 2]"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or (_is_integer(self.seed) and 0 <= self.seed <= MAX_SEED),
             f"null or an integer in [0, {MAX_SEED}]"),
        )
        for name, holds, rule in rules:
            if not holds:
                raise RequestError(name, f"{name}={getattr(self, name)!r} must be {rule}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not (isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_STRINGS
                and all(isinstance(s, str) and s for s in stop)):
            raise RequestError("stop", f"stop={self.stop!r} must be a non-empty string or a list of at most "
                                       f"{MAX_STOP_STRINGS} non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


# -- per-request sampling inside the continuous batch --------------------------------------------


def _request_sampler_class():
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    class RequestSampler(ContinuousBatchingLogitsProcessor):
        """Draws each sampled request's next token with its own generator; greedy rows pass through.

        The manager gives each request's `logit_processor_kwargs` ({"slot": n}) to
        `prepare_tensor_args` and the rows of scores in the same order to `__call__`."""

        supported_kwargs = {"slot": int}
        ignored_kwargs = ()

        def __init__(self):
            self._slots: dict[int, tuple[float, float, torch.Generator]] = {}
            self._lock = threading.Lock()

        def add(self, slot: int, params: SamplingParams, device: torch.device) -> None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
            with self._lock:
                self._slots[slot] = (params.temperature, params.top_p, generator)

        def remove(self, slot: int) -> None:
            with self._lock:
                self._slots.pop(slot, None)

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(-1)  # no slot: greedy

        def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
            slots = [r.state.logit_processor_kwargs.get("slot", -1) for r in requests_with_new_token]
            return torch.tensor(slots, dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            rows = tensor_arg[: scores.size(0)].tolist()
            with self._lock:
                drawn = [(row, self._slots.get(slot)) for row, slot in enumerate(rows) if slot >= 0]
            for row, sampling in drawn:
                if sampling is None:  # cancelled between scheduling and this step
                    continue
                temperature, top_p, generator = sampling
                token = _draw(scores[row], temperature, top_p, generator)
                scores[row] = float("-inf")
                scores[row, token] = 0.0
            return scores

    return RequestSampler


def _draw(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token id from softmax(logits / temperature), restricted to the top_p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (V,)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p  # the mass before it already reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


# -- one request ----------------------------------------------------------------------------------


class _StopText:
    """Cuts the text before the first stop string, holding back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buffer = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        self.buffer += piece
        found = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if found:
            text, self.buffer = self.buffer[: min(found)], ""
            return text, True
        emit = len(self.buffer) - self.hold
        text, self.buffer = self.buffer[: max(emit, 0)], self.buffer[max(emit, 0):]
        return text, False

    def flush(self) -> str:
        text, self.buffer = self.buffer, ""
        return text


@dataclass(eq=False)
class Completion:
    """One request in the continuous batch: iterate `deltas()` for its text as it is generated."""

    id: str
    prompt_tokens: int
    params: SamplingParams
    generator: "Generator"
    slot: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    """'stop' (a stop string or the end-of-sequence token) or 'length' (max_tokens), once done."""
    _outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    _done: bool = False

    def _push(self, output) -> None:  # on the event loop, from the dispatcher
        self._outputs.put_nowait(output)

    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces in order; when it ends, `finish_reason` and `completion_tokens` are set."""
        from tokenizers.decoders import DecodeStream

        tokenizer = self.generator.tokenizer
        stream = DecodeStream([], skip_special_tokens=True)
        stop = _StopText(self.params.stop)
        tokens: list[int] = []
        streamed = ""
        try:
            while True:
                output = await self._outputs.get()
                while not self._outputs.empty():  # behind: each output holds all tokens so far, the last is enough
                    output = self._outputs.get_nowait()
                if output.error is not None:
                    raise GenerationError(f"request {self.id} failed: {output.error}")
                for token in output.generated_tokens[len(tokens):]:
                    tokens.append(token)
                    if token in self.generator.eos_token_ids:  # the last one: it ends the text, it is not text
                        break
                    piece = stream.step(tokenizer, token)
                    if piece:
                        streamed += piece
                        text, stopped = stop.feed(piece)
                        if text:
                            yield text
                        if stopped:
                            self._finish("stop", len(tokens))
                            return
                if output.is_finished():
                    break
            # Bytes the stream still holds (an unfinished UTF-8 character) decode as U+FFFD, as decode() does.
            # A stop token is no text even where the tokenizer does not call it special (an end-of-turn
            # marker added as a plain token): skip_special_tokens alone would leave it in the answer.
            is_eos = bool(tokens) and tokens[-1] in self.generator.eos_token_ids
            full = tokenizer.decode(tokens[:-1] if is_eos else tokens, skip_special_tokens=True)
            tail, stopped = stop.feed(full[len(streamed):] if full.startswith(streamed) else "")
            tail += "" if stopped else stop.flush()
            if tail:
                yield tail
            self._finish("stop" if stopped or is_eos or len(tokens) < self.params.max_tokens else "length",
                         len(tokens))
        finally:
            if not self._done:  # the consumer went away (client disconnected) or an error
                self.cancel()

    async def text(self) -> str:
        return "".join([piece async for piece in self.deltas()])

    async def token_ids(self) -> tuple[list[int], bool]:
        """The generated token ids and whether max_tokens cut them (no end reached). An end-of-sequence
        token that ends them is included; a stop string ends them after the token that completes it
        (rollouts train on tokens, so the tokens are kept whole rather than the text cut)."""
        tokenizer, stops = self.generator.tokenizer, self.params.stop
        tokens: list[int] = []
        try:
            while True:
                output = await self._outputs.get()
                while not self._outputs.empty():  # each output holds all tokens so far
                    output = self._outputs.get_nowait()
                if output.error is not None:
                    raise GenerationError(f"request {self.id} failed: {output.error}")
                for token in output.generated_tokens[len(tokens):]:
                    tokens.append(token)
                    ended = token in self.generator.eos_token_ids
                    if not ended and stops:  # the text so far held no stop string: a new one ends here
                        text = tokenizer.decode(tokens, skip_special_tokens=True)
                        ended = any(stop in text for stop in stops)
                    if ended:
                        self._finish("stop", len(tokens))
                        return tokens, False
                if output.is_finished():
                    break
            truncated = len(tokens) >= self.params.max_tokens
            self._finish("length" if truncated else "stop", len(tokens))
            return tokens, truncated
        finally:
            if not self._done:
                self.cancel()

    @property
    def usage(self) -> dict:
        """Token counts as OpenAI reports them."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _finish(self, reason: str, tokens: int) -> None:
        self.finish_reason, self.completion_tokens = reason, tokens
        self.cancel()  # a stop string ends it before the manager does; after the manager's finish, only forgets it

    def cancel(self) -> None:
        """Stop decoding this request and free its place (idempotent)."""
        if not self._done:
            self._done = True
            self.generator._forget(self)


# -- the shared decoding loop ---------------------------------------------------------------------


def serving_device(flag: str | None) -> torch.device:
    """The device a `--device` flag names (None: cuda if available, else cpu); a ValueError naming the
    flag when torch cannot read it or this machine has no such device."""
    if flag is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(flag)
    except RuntimeError:
        raise ValueError(f"--device={flag!r} is not a device: cpu, cuda, cuda:N, ...") from None
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        why = "" if torch.cuda.is_available() else " (torch.cuda.is_available() is False)"
        raise ValueError(f"--device={flag!r}: this machine has {torch.cuda.device_count()} CUDA device(s){why}; "
                         "use --device=cpu")
    return device


def _load_model(model_dir: Path):
    """AutoModelForCausalLM of `model_dir`; weights that cannot be read (a truncated or damaged
    model.safetensors) are a ModelLoadError naming the directory, not safetensors' own exception."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", local_files_only=True)
    except (SafetensorError, OSError, ValueError) as error:
        raise ModelLoadError(f"{model_dir}: its model cannot be loaded ({type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else 'no detail'}); a weights file is "
                             "truncated or damaged: copy it again, or serve the run directory, whose servable/ "
                             "copy is checked and rebuilt") from None


class Generator:
    """Transformers' continuous batching over one model: a directory (config.json + tokenizer.json)
    or a live transformers module (the policy of an RL run: its weights as they are now).

    Args:
        model: a transformers directory (see ddptrain.serving.servable.servable_dir for run
            directories), or a transformers module (a peft model too: it generates with its adapter
            on), used where it is, in whatever mode the caller keeps it.
        tokenizer: a `tokenizers.Tokenizer`; for a directory, None reads its tokenizer.json.
        eos_token_ids: the tokens that end a sequence; None takes the model's generation_config.
        max_active: sequences decoded together in one forward pass.
        max_queue: requests that may wait for a place beyond those; more raise QueueFull.
        device: where a directory's model runs ("cpu", "cuda", ...; default: cuda if available);
            a module stays on its own device.
        kv_cache_mb: upper bound of the paged KV cache (its default size fills free memory on CPU).
    """

    def __init__(self, model, *, tokenizer=None, eos_token_ids=None, max_active: int = 32, max_queue: int = 256,
                 device: str | None = None, kv_cache_mb: float = 1024.0):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only
        from tokenizers import Tokenizer

        if max_active < 1 or max_queue < 0:
            raise ValueError(f"max_active={max_active} must be >= 1 and max_queue={max_queue} >= 0")
        if not kv_cache_mb > 0 or math.isinf(kv_cache_mb):
            raise ValueError(f"kv_cache_mb={kv_cache_mb} must be a finite number of MiB > 0")
        self.max_active, self.max_queue, self.kv_cache_mb = max_active, max_queue, kv_cache_mb
        if isinstance(model, torch.nn.Module):
            self.model_dir = None
            self.model = model
            self.device = next(model.parameters()).device
            self.model_name = type(model).__name__
        else:
            self.model_dir = Path(model)
            self.device = serving_device(device)
            self.model = _load_model(self.model_dir)
            self.model.to(self.device).eval()
            resolved = self.model_dir.resolve()
            self.model_name = resolved.parent.name if resolved.name == "servable" else resolved.name  # RUN_DIR/servable
        self.tokenizer = tokenizer or Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.longest_token_chars = max(1, *(len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True)))
        """Characters of the vocabulary's longest token: no token covers more of a text."""
        config = self.model.config.get_text_config()
        self.context: int | None = (getattr(config, "max_position_embeddings", None)
                                    or getattr(config, "n_positions", None))
        if eos_token_ids is None:
            eos = self.model.generation_config.eos_token_id
            eos_token_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        self.eos_token_ids = set(eos_token_ids)
        self._requests: dict[str, Completion] = {}
        self._slots = itertools.count()
        self._manager = None
        self._sampler = _request_sampler_class()()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatcher: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- requests --

    def prepare(self, prompt: str, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or RequestError when the request cannot fit the model."""
        if not isinstance(prompt, str):
            raise RequestError("prompt", f"prompt must be a string, not {type(prompt).__name__}")
        check_text(prompt, "prompt")
        ids = self.tokenizer.encode(prompt).ids
        self.check_fits(ids, params)
        return ids

    def check_fits(self, ids: list[int], params: SamplingParams | None, field_name: str = "prompt",
                   described: str = "prompt") -> None:
        """RequestError unless the prompt `ids` (and params.max_tokens more; params None: the prompt alone)
        fit the model's context; `field_name` is the request field the ids came from, `described` what
        the message calls them."""
        if not ids:
            raise RequestError(field_name, f"{described} is empty: the model needs at least one token to continue")
        if self.context is None:
            return
        if len(ids) >= self.context:
            raise RequestError(field_name, f"{described} is {len(ids)} tokens, longer than the model's context of "
                                           f"{self.context} positions allows (at most {self.context - 1})")
        if params is not None and len(ids) + params.max_tokens > self.context:
            raise RequestError("max_tokens", f"max_tokens={params.max_tokens} with a {described} of {len(ids)} tokens "
                                             f"exceeds the model's context of {self.context} positions; "
                                             f"max_tokens must be <= {self.context - len(ids)}")

    def room(self, ids: list[int]) -> int | None:
        """Tokens that fit after the prompt `ids` in the model's context (None: the context is unknown)."""
        return None if self.context is None else self.context - len(ids)

    def submit(self, prompt_ids: list[int], params: SamplingParams, stream: bool = True) -> Completion:
        """Add a request to the running batch (call on the event loop that ran `start`).

        stream=False: the text is wanted only at the end, so the manager reports the request once, when
        it is done, instead of after every token (unless stop strings need watching the text grow)."""
        if not self.is_healthy():
            raise GenerationError("the decoding loop is not running")
        if len(self._requests) >= self.max_active + self.max_queue:
            raise QueueFull(f"{len(self._requests)} requests in flight, the most this server holds "
                            f"(max_active={self.max_active} + max_queue={self.max_queue})")
        slot = next(self._slots)
        completion = Completion(f"cmpl-{slot}-{secrets.token_hex(4)}", len(prompt_ids), params, self, slot)
        kwargs = {}
        if not params.is_greedy:
            self._sampler.add(slot, params, self.device)
            kwargs["slot"] = slot
        self._requests[completion.id] = completion
        self._manager.add_request(prompt_ids, request_id=completion.id, max_new_tokens=params.max_tokens,
                                  streaming=stream or bool(params.stop), **kwargs)
        return completion

    def _forget(self, completion: Completion) -> None:
        # Still registered: the manager has not finished it (a stop string, a disconnect), so cancel it there.
        if self._requests.pop(completion.id, None) is not None and self._manager is not None:
            self._manager.cancel_request(completion.id)
        self._sampler.remove(completion.slot)

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    # -- lifecycle --

    def start(self) -> "Generator":
        """Start the decoding loop; call from the event loop that will submit requests."""
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList)
        from transformers.generation.logits_process import LogitsProcessorList

        self._loop = asyncio.get_running_loop()
        eos = sorted(self.eos_token_ids)
        # do_sample=False: the manager takes the argmax; RequestSampler makes it the drawn token where sampled.
        generation_config = GenerationConfig(do_sample=False, eos_token_id=eos[0] if len(eos) == 1 else eos or -1)
        self._manager = self.model.init_continuous_batching(generation_config=generation_config,
                                                            continuous_batching_config=self._cache_config())
        processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([self._sampler]))
        processors.tensors_required = 1  # one int32 row per step: each request's slot
        self._manager.logit_processor = processors  # before start(): the batch processor is built from it
        with torch.inference_mode():  # the manager's thread runs in the caller's inference mode
            self._manager.start()
        self._dispatcher = threading.Thread(target=self._dispatch, name="ddptrain-generate-dispatch", daemon=True)
        self._dispatcher.start()
        return self

    def _cache_config(self):
        """The paged KV cache sized for max_active full-context sequences, at most kv_cache_mb.

        Left unsized, transformers fills a share of free memory, which on CPU makes the first
        request wait for a large allocation (docs/serving.md)."""
        from transformers import ContinuousBatchingConfig

        config = self.model.config.get_text_config()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bytes_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * self.model.dtype.itemsize
        context = self.context or 2048
        page_size = min(256, context)
        pages_per_sequence = math.ceil(context / page_size)
        budget = int(self.kv_cache_mb * 2**20 // (bytes_per_token * page_size))
        num_blocks = max(pages_per_sequence, min(self.max_active * pages_per_sequence, budget))
        return ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                        max_batch_tokens=max(2 * self.max_active, min(context, 1024)),
                                        max_requests_per_batch=self.max_active, use_cuda_graph=False)

    def _dispatch(self) -> None:
        """Moves the manager's outputs to their requests on the event loop, a batch at a time."""
        manager = self._manager
        while True:
            output = manager.get_result(timeout=0.1)
            if output is None:  # nothing for 0.1 s: the end, once close() asked and all is delivered
                if self._stopping.is_set():
                    return
                if not manager.is_running():
                    self._stopping.wait(0.1)
                continue
            batch = [output]
            while (output := manager.get_result(timeout=0)) is not None:
                batch.append(output)
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return

    def _deliver(self, outputs) -> None:
        for output in outputs:
            completion = self._requests.get(output.request_id)
            if completion is None:
                continue  # cancelled
            completion._push(output)
            if output.is_finished():  # the manager is done with it: its place is free now
                self._requests.pop(completion.id, None)
                self._sampler.remove(completion.slot)

    def is_healthy(self) -> bool:
        manager = self._manager
        return (manager is not None and manager.is_running()
                and manager.background_thread_status.fatal_error is None)

    def close(self) -> None:
        """Stop the decoding loop and fail what is still in flight."""
        if self._manager is not None and self._manager.is_running():
            self._manager.stop(block=True, timeout=10, hard_stop=True)  # fail what is in flight, do not finish it
        self._stopping.set()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=5)
        self._manager = None


def quiet_transformers() -> None:
    """Command-line tools: no progress bars and no per-request info lines from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)

"""Chat tokenizers and templates for data=sft: token ids and a target mask for each example.

The tokenizer is what transformers' AutoTokenizer loads from the directory of `data.tokenizer`
(tokenizer.json and tokenizer_config.json: the EOS token and the chat template), or
`data.chat_template=PATH` instead of its template. `mask[i] == 1` says token i is a target.

- A template that marks assistant text with `{% generation %}`: the mask IS transformers'
  `return_assistant_tokens_mask`.
- A template without markers: the conversation is rendered message by message; the first k
  messages' text and tokens must be prefixes of the whole conversation's, for every k, so the
  messages tile the tokens exactly. An assistant span runs from after its generation prompt to its
  end-of-turn token (a separator after it, like ChatML's newline, is not a target). A template that
  cannot be split so is refused, naming the conversation and the message.
- Either way the end-of-turn marker (`<|im_end|>`, `<|eot_id|>`) must be one token, or it would be
  trained as text and generation could not stop at it; and a message's content may not hold the
  text of a special token or of that marker (`special_text_in`; data/sft.py refuses the record), or
  data could forge the end of a turn or the start of another.
- Prompt-completion strings: prompt tokens (with the tokenizer's own special tokens, e.g. BOS),
  completion tokens, then EOS; the completion and EOS are the targets.
The rules in full, with the errors they give: docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import threading
from pathlib import Path

from ddptrain.data.sources import DataError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
"""The tokenizer files AutoTokenizer reads of a directory, and so what the fingerprint hashes. It also reads
config.json, whose model_type (or tokenizer_class) may pick the tokenizer class: that class is fingerprinted
as `tokenizer_class` rather than config.json's bytes, which hold the model's architecture too."""
_PROBE = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello"}]
"""A one-exchange conversation whose rendering shows the template's end-of-turn marker."""
_NO_SPLIT_HINT = "give a template that marks assistant text with {% generation %} (data.chat_template=PATH)"


MAX_TEMPLATE_BYTES = 1 << 20
"""A data.chat_template file's size limit: the templates of the common models are a few KB."""
RENDER_TIMEOUT_S = 60
"""How long one conversation may take to render (a well-formed template takes milliseconds)."""
MAX_RENDERED_CHARS = 16 << 20
"""What one conversation may render to: far more than any context holds."""


class _RenderTimeout(BaseException):
    """Raised into a render that passed RENDER_TIMEOUT_S: a BaseException, so that no `except Exception`
    of Jinja or transformers on the way out takes it for the template's own error."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """_RenderTimeout after `seconds`, by SIGALRM: in the main thread, where preprocessing runs
    (elsewhere, or where signals are not available, no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise _RenderTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def _transformers(user: str = "data=sft"):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only
    try:
        import transformers
    except ImportError:
        raise DataError(f"{user} needs transformers: pip install 'ddptrain[hf]'") from None
    return transformers


class ChatTokenizer:
    """A transformers tokenizer with an EOS token, and the chat template that renders conversations."""

    needs_text = True

    def __init__(self, spec: str | None, chat_template: str | None = None, user: str = "data=sft"):
        """`user`: what needs the chat tokenizer (data=sft, data=preference, evaluate --chat-template), for
        the messages."""
        if spec in (None, "byte"):
            raise DataError(f"{user} needs a real tokenizer with an EOS token, not the byte tokenizer: use model=hf "
                            "with a tokenizer in model.path, or data.tokenizer=<dir>/tokenizer.json")
        transformers = _transformers(user)
        import tokenizers  # transformers' backend, installed with it

        self.path = Path(spec).expanduser()
        if not self.path.is_file():
            raise DataError(f"data.tokenizer: {self.path} is not a file ({user} expects a tokenizer.json, read "
                            "with the tokenizer_config.json beside it)")
        directory = self.path.parent
        if (directory / "tokenizer_config.json").is_file():
            if self.path.name != "tokenizer.json":  # AutoTokenizer would read the directory's tokenizer.json
                raise DataError(f"data.tokenizer: {self.path} lies beside a tokenizer_config.json, so {user} reads "
                                "the directory as transformers saved it, whose tokenizer file is tokenizer.json, not "
                                f"{self.path.name}; name it tokenizer.json, or move it to a directory of its own")
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            self.files = [directory / name for name in _TOKENIZER_FILES if (directory / name).is_file()]
        else:
            self.tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(self.path))
            self.files = [self.path]
        self.tokenizer_class = type(self.tokenizer).__name__
        if self.tokenizer.eos_token_id is None:
            raise DataError(f"data.tokenizer: {self.path} has no EOS token (eos_token in tokenizer_config.json): "
                            f"{user} ends every completion with it")
        self.template = self._template(chat_template)
        self.template_source = f"data.chat_template={chat_template}" if chat_template else f"of {self.path}"
        self._end_of_turn_checked = False
        self._end_of_turn_id: int | None = None  # the marker's token, once _check_end_of_turn has read it
        self.has_generation_markers = bool(self.template and _GENERATION.search(self.template))
        self.vocab_size = len(self.tokenizer)
        self.name = str(self.path)
        self.eos_id = int(self.tokenizer.eos_token_id)
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {})
        self.special_ids = set(self.tokenizer.all_special_ids) | {i for i, t in decoder.items() if t.special}
        self._added_texts = {i: token.content for i, token in decoder.items()}
        self._special_texts: re.Pattern | None = None  # special_text_in's, once the end-of-turn marker is known
        self._version = transformers.__version__
        self._tokenizers_version = tokenizers.__version__

    def _template(self, path: str | None) -> str | None:
        if path is not None:
            file = Path(path).expanduser()
            if not file.is_file():
                raise DataError(f"data.chat_template: {file} is not a file (a Jinja chat template)")
            size = file.stat().st_size
            if size > MAX_TEMPLATE_BYTES:
                raise DataError(f"data.chat_template={path}: {file} is {size} bytes, more than a chat template's "
                                f"limit of {MAX_TEMPLATE_BYTES} (templates of the common models are a few KB)")
            try:
                return file.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"data.chat_template={path} is not UTF-8 text ({error}); save the template as "
                                "UTF-8") from None
        try:
            return self.tokenizer.get_chat_template()
        except ValueError:  # transformers: "Cannot use chat template functions because ... not set"
            return None

    def fingerprint(self) -> str:
        digest = hashlib.sha256(self._version.encode())
        for file in self.files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
        digest.update((self.template or "").encode("utf-8"))
        return "chat:" + digest.hexdigest()

    def library_versions(self) -> dict:
        """The libraries that tokenize and render, by version (the cache key's; the fingerprint has transformers')."""
        return {"transformers": self._version, "tokenizers": self._tokenizers_version}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def stop_ids(self) -> list[int]:
        """The tokens that end what the model is trained to write, for generation to stop at: EOS (the
        end of a completion) and the end-of-turn token of an assistant message: the last target of a
        one-exchange conversation when it is a special token (as the mask decides it, below), and the
        template's end-of-turn marker when it is one token and a target, special or not (an added token
        that is not special; a {% generation %} template may put a separator inside after it)."""
        ids = {self.eos_id}
        try:  # the first conversation checks the end-of-turn marker (_end_of_turn_id)
            tokens, mask = self.conversation("the end-of-turn probe", _PROBE, 0) if self.template else ([], [])
        except DataError:  # a template that needs other messages: EOS alone
            tokens, mask = [], []
        targets = [token for token, is_target in zip(tokens, mask) if is_target]
        if targets and targets[-1] in self.special_ids:
            ids.add(targets[-1])
        if self._end_of_turn_id is not None and self._end_of_turn_id in targets:
            ids.add(self._end_of_turn_id)
        return sorted(ids)

    def special_text_in(self, text: str) -> str | None:
        """The first text in `text` that the tokenizer reads as a special token, or as the template's
        end-of-turn marker when that is an added token (None: there is none). Other added tokens, like
        <think>, are vocabulary the data may write."""
        if self._special_texts is None:
            self._checked_end_of_turn()
            ids = set(self.special_ids)
            if self._end_of_turn_id in self._added_texts:
                ids.add(self._end_of_turn_id)
            # Only what encodes to its one token (a special token that is not an added token, or one the
            # tokenizer splits, is text); whitespace is everyday text, whatever a tokenizer calls it.
            text_of = {i: self._added_texts.get(i) or self.tokenizer.convert_ids_to_tokens(i) for i in ids}
            texts = sorted((t for i, t in text_of.items() if t and not t.isspace() and self.encode(t) == [i]),
                           key=len, reverse=True)
            self._special_texts = re.compile("|".join(map(re.escape, texts)) or r"(?!)")
        found = self._special_texts.search(text)
        return found.group() if found else None

    # -- prompt-completion strings -------------------------------------------------------------------

    def prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """Prompt tokens (the tokenizer's special tokens included), completion tokens, EOS."""
        prompt_ids = list(self.tokenizer(prompt)["input_ids"])
        completion_ids = self.encode(completion) + [self.eos_id]
        return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)

    # -- conversations -------------------------------------------------------------------------------

    def conversation(self, name: str, messages: list[dict], first_target: int) -> tuple[list[int], list[int]]:
        """(ids, mask) of a conversation whose assistant messages from index `first_target` on are targets."""
        if self.template is None:
            raise DataError(f"{name}: the tokenizer {self.path} has no chat template (chat_template.jinja or "
                            "tokenizer_config.json), needed for conversations; give data.chat_template=PATH")
        self._checked_end_of_turn()
        if self.has_generation_markers:  # the template decides; else _end_of_turn, alike for both kinds of marker
            rendered = self._apply(name, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(rendered["input_ids"]), list(rendered["assistant_masks"])
            if first_target:
                text = self._apply(name, messages)
                start = self._prefix_tokens(name, messages[:first_target], text, ids, "")
                mask[:start] = [0] * start
            return ids, mask
        return self._split_by_prefixes(name, messages, first_target)

    def _end_of_turn_marker(self) -> str | None:
        """The template's end-of-turn marker: the first text after an assistant message's content,
        whitespace aside (None: the template writes nothing there). A DataError when the template
        cannot render the probe (it needs other messages)."""
        text = self._apply("the end-of-turn probe", _PROBE)
        content = _PROBE[-1]["content"]
        at = text.rfind(content)
        after = text[at + len(content):].split() if at >= 0 else []
        return after[0] if after else None

    def _checked_end_of_turn(self) -> None:
        if not self._end_of_turn_checked and self.template is not None:
            self._check_end_of_turn()
            self._end_of_turn_checked = True

    def _check_end_of_turn(self) -> None:
        """Refuse a template whose end-of-turn marker the tokenizer splits into several tokens: ChatML on a
        tokenizer without `<|im_end|>` as an added token. A template that writes nothing there, or cannot
        render the probe (it needs other messages), has no marker to check."""
        try:
            marker = self._end_of_turn_marker()
        except DataError:
            return
        if marker is None:
            return
        ids = self.encode(marker)
        if len(ids) != 1:
            raise DataError(f"the chat template {self.template_source} ends an assistant turn with {marker!r}, which "
                            f"the tokenizer {self.path} splits into {len(ids)} tokens {ids}: the template's turn "
                            "markers must each be one token of the tokenizer (the end-of-turn token is a target and "
                            f"where generation stops); add {marker!r} to the tokenizer as a special token "
                            "(tokenizer.add_special_tokens), or give a template written for this tokenizer "
                            "(data.chat_template=PATH)")
        self._end_of_turn_id = ids[0]

    def _apply(self, name: str, messages: list[dict], **kwargs):
        try:
            with _deadline(RENDER_TIMEOUT_S):
                rendered = self.tokenizer.apply_chat_template(messages, chat_template=self.template,
                                                              **{"tokenize": False, **kwargs})
        except _RenderTimeout:
            raise DataError(f"{name}: the chat template ({self.template_source}) took more than {RENDER_TIMEOUT_S} s "
                            "to render the conversation, the limit of one render (a template that loops?)") from None
        except Exception as error:  # a Jinja error, or the template's own raise_exception(...)
            raise DataError(f"{name}: the chat template failed to render the conversation: "
                            f"{type(error).__name__}: {error}") from None
        size = len(rendered) if isinstance(rendered, str) else len(rendered["input_ids"])
        if size > MAX_RENDERED_CHARS:
            raise DataError(f"{name}: the chat template ({self.template_source}) rendered the conversation to {size} "
                            f"characters, more than the limit of {MAX_RENDERED_CHARS} for one conversation (a "
                            "template that repeats its text?)")
        return rendered

    def _prefix_tokens(self, name: str, prefix: list[dict], text: str, ids: list[int], what: str,
                       generation_prompt: bool = False) -> int:
        """How many of the whole conversation's tokens the first len(prefix) messages render to (with
        the generation prompt: the header before an assistant message, even before the first message)."""
        if not prefix and not generation_prompt:
            return 0
        if prefix:
            prefix_text = self._apply(name, prefix, add_generation_prompt=generation_prompt)
        else:
            prefix_text = self._generation_prompt_alone(name)
        where = f"the first {len(prefix)} message(s){what}"
        if not text.startswith(prefix_text):
            at = next((i for i, (a, b) in enumerate(zip(prefix_text, text)) if a != b), min(len(prefix_text), len(text)))
            raise DataError(f"{name}: the chat template cannot be split into messages: {where} render to text that is "
                            f"not a prefix of the whole conversation's (they differ at character {at}); {_NO_SPLIT_HINT}")
        prefix_ids = self.encode(prefix_text)
        if ids[: len(prefix_ids)] != prefix_ids:
            raise DataError(f"{name}: the chat template cannot be split into messages: {where} tokenize differently "
                            f"from the start of the whole conversation (a token spans the boundary); {_NO_SPLIT_HINT}")
        return len(prefix_ids)

    def _generation_prompt_alone(self, name: str) -> str:
        """The template's text for no message and the generation prompt: what comes before a conversation
        opened by the assistant (a BOS, a default system prompt, the assistant's header). transformers'
        apply_chat_template refuses an empty conversation, so its own renderer is called as it calls it."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(conversations=[[]], chat_template=self.template,
                                                add_generation_prompt=True, **self.tokenizer.special_tokens_map)
        except Exception as error:  # a template that reads messages[0]
            raise DataError(f"{name}: the chat template cannot be split into messages: it cannot render the "
                            f"generation prompt before the first message, an assistant's ({type(error).__name__}: "
                            f"{error}); {_NO_SPLIT_HINT}") from None
        return rendered[0]

    def _split_by_prefixes(self, name: str, messages: list[dict], first_target: int) -> tuple[list[int], list[int]]:
        text = self._apply(name, messages)
        ids = self.encode(text)
        mask = [0] * len(ids)
        # Every message's end is a token boundary of the whole: the messages tile its tokens.
        ends = [self._prefix_tokens(name, messages[: k + 1], text, ids, "") for k in range(len(messages) - 1)]
        ends.append(len(ids))
        for k, message in enumerate(messages):
            if k < first_target or message["role"] != "assistant":
                continue
            start = self._prefix_tokens(name, messages[:k], text, ids, " with the generation prompt",
                                        generation_prompt=True)
            if start > ends[k]:
                raise DataError(f"{name}: the chat template cannot be split into messages: the generation prompt "
                                f"before message {k + 1} is longer than the message; {_NO_SPLIT_HINT}")
            end = self._end_of_turn(ids, start, ends[k])
            mask[start:end] = [1] * (end - start)
        return ids, mask

    def _end_of_turn(self, ids: list[int], start: int, end: int) -> int:
        """The span's end through its end-of-turn token (its last special token, or the template's
        end-of-turn marker, which may be an added token that is not special) when only a separator
        (whitespace, like ChatML's newline) follows it; else the message's end."""
        closing = [i for i in range(start, end) if ids[i] in self.special_ids or ids[i] == self._end_of_turn_id]
        if closing and not self.tokenizer.decode(ids[closing[-1] + 1 : end]).strip():
            return closing[-1] + 1
        return end

"""OpenAI's chat format for `POST /v1/chat/completions`: the rules of `messages`, the prompt rendered
with the served tokenizer's chat template, and the chat.completion objects.

The prompt is the one the model was tuned on: transformers' `apply_chat_template(messages,
add_generation_prompt=True)` with the template saved beside tokenizer.json (`chat_template.jinja`,
or `chat_template` in tokenizer_config.json), which ends by opening the assistant's turn; the
completion is that turn. Control tokens written inside a message's content are encoded as text
(transformers' `sanitize_control_tokens`): a client cannot end a turn or open another role by
typing the template's markers, only the template writes them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ddptrain.generation.generator import Completion, RequestError, check_text

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content")
RENDERED = "rendered chat"
"""What error messages call the prompt of a chat request."""


def check_messages(messages) -> list[dict]:
    """`messages` as the template takes them ({role, content} dicts), or RequestError naming the message
    (`messages[2].role`) and the rule."""
    if not isinstance(messages, list) or not messages:
        shown = "[]" if isinstance(messages, list) else type(messages).__name__
        raise RequestError("messages", f"messages must be a non-empty list of {{role, content}} objects, not {shown}")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(where, f"{where} must be an object with role and content, not "
                                      f"{type(message).__name__}")
        unknown = sorted(set(message) - set(MESSAGE_KEYS))
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", f"{where} has the unknown key {unknown[0]!r}; a message "
                                                        f"holds {' and '.join(MESSAGE_KEYS)}")
        for key in MESSAGE_KEYS:
            if key not in message:
                raise RequestError(f"{where}.{key}", f"{where}.{key} is required")
        if not (isinstance(message["role"], str) and message["role"] in ROLES):
            raise RequestError(f"{where}.role", f"{where}.role={message['role']!r} must be one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            parts = " (content parts, such as text or image objects, are not supported)" \
                if isinstance(message["content"], list) else ""
            raise RequestError(f"{where}.content", f"{where}.content must be a string, not "
                                                   f"{type(message['content']).__name__}{parts}")
        check_text(message["content"], f"{where}.content")
    return [{"role": message["role"], "content": message["content"]} for message in messages]


class ChatTemplate:
    """The served tokenizer's chat template: `render(messages)` is the prompt's token ids, or a 400 that
    says why the model cannot chat (the server still answers /v1/completions)."""

    def __init__(self, tokenizer, unavailable: str | None = None):
        self.tokenizer = tokenizer
        self.unavailable = unavailable
        """Why there is no template to render with (None: there is one)."""

    @classmethod
    def load(cls, model_dir: str | Path) -> "ChatTemplate":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError, ImportError) as error:
            return cls(None, f"the served model's tokenizer does not load in transformers ({error})")
        if not tokenizer.chat_template:
            return cls(None, "the served model has no chat template (chat_template.jinja, or chat_template in "
                             "tokenizer_config.json, beside tokenizer.json)")
        return cls(tokenizer)

    @property
    def is_available(self) -> bool:
        return self.unavailable is None

    def render(self, messages: list[dict]) -> list[int]:
        """The token ids of `messages` rendered with the template, the assistant's turn opened."""
        if not self.is_available:
            raise RequestError("messages", f"{self.unavailable}, so messages cannot be rendered into a prompt; "
                                           "save one with tokenizer.save_pretrained, or send the prompt written "
                                           "out to /v1/completions")
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, sanitize_control_tokens=True)
        except TemplateError as error:  # the template's own raise_exception("..."), or a template bug
            raise RequestError("messages", f"the model's chat template refused the messages: {error}") from None
        return list(ids)


class ChatBodies:
    """OpenAI's chat.completion answer and its chat.completion.chunk stream: an opening chunk with the
    assistant's role, one chunk per text piece, a last one with finish_reason and usage."""

    def __init__(self, model: str):
        self.model = model

    def _body(self, completion: Completion, kind: str, **choice) -> dict:
        return {"id": f"chat{completion.id}", "object": kind, "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, **choice, "logprobs": None}]}

    def answer(self, completion: Completion, text: str) -> dict:
        return {**self._body(completion, "chat.completion", message={"role": "assistant", "content": text},
                             finish_reason=completion.finish_reason),
                "usage": completion.usage}

    def opening(self, completion: Completion) -> list[dict]:
        return [self._body(completion, "chat.completion.chunk", delta={"role": "assistant", "content": ""},
                           finish_reason=None)]

    def chunk(self, completion: Completion, piece: str, finish_reason: str | None) -> dict:
        if finish_reason is None:
            return self._body(completion, "chat.completion.chunk", delta={"content": piece}, finish_reason=None)
        return {**self._body(completion, "chat.completion.chunk", delta={}, finish_reason=finish_reason),
                "usage": completion.usage}

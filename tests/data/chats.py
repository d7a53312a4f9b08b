"""Chats for the data=sft tests: a chat tokenizer trained here (no hub) with a ChatML template that
marks the assistant's tokens, and random multi-turn chats whose targets per chat differ widely.
"""

from __future__ import annotations

import json
import random

from tests.helpers import import_optional

WORDS = ("the a of to and is in it you that he was for on are with as I his they be at one have this from or had "
         "by hot word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him two has "
         "look more day could go come did number sound no most people my over know water than call first who may "
         "down side been now find hello there fine answer question sure thanks").split()
SPECIAL = ["<|im_start|>", "<|im_end|>", "<eos>"]
# ChatML with the assistant's content and end-of-turn token inside {% generation %}, the newline after it outside.
MARKED = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def save_chat_tokenizer(directory, template: str | None = MARKED, special: list[str] = SPECIAL):
    """A BPE tokenizer trained here (no hub), as transformers saves it: tokenizer.json, tokenizer_config.json
    (EOS <eos>) and chat_template.jinja; `special`: its special (added) tokens."""
    tokenizers = import_optional("tokenizers")
    transformers = import_optional("transformers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=700, special_tokens=special,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS), "system\nuser\nassistant\n"] + [" ".join(random.Random(i).sample(WORDS, 12))
                                                               for i in range(300)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    if template is not None:
        fast.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def random_chats(count: int, seed: int = 0) -> list[dict]:
    """Multi-turn chats whose assistant replies are 1 to 24 words: targets per chat differ widely."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        messages = [{"role": "system", "content": sentence(rng, 2, 6)}] if rng.random() < 0.4 else []
        for _ in range(rng.choice([1, 1, 2, 3])):
            messages.append({"role": "user", "content": sentence(rng, 2, 8)})
            messages.append({"role": "assistant", "content": sentence(rng, 1, 1 if rng.random() < 0.4 else 14)})
        chats.append({"messages": messages})
    return chats


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)

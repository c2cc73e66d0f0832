"""The synthetic chat tasks of the tiny CPU recipe, and their word-level tokenizer.

Every answer is fully determined by its prompt, so a target can solve the tasks exactly and a
draft can then learn to predict that target:

- ``count up from 37 to 52`` -> ``37 38 ... 52``
- ``count down from 90 to 81`` -> ``90 89 ... 81``
- ``count from 12 to 27 by 3`` -> ``12 15 18 21 24 27``
- ``copy alpha kilo echo`` -> ``alpha kilo echo``

Numbers 0..299 and every word are single tokens (``build_tokenizer``).
"""

from __future__ import annotations

import hashlib
import random

# Fixed ids: the tiny configs' bos/eos/pad and their DSpark noise (mask) token.
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<mask>", "<|user|>", "<|assistant|>", "<unk>")
COPY_WORDS = (
    "alpha beta gamma delta echo fox golf hotel india juliet kilo lima "
    "mike november oscar papa quebec romeo sierra tango uniform victor whiskey yankee"
).split()
WORDS = ("please", "count", "up", "down", "from", "to", "by", "copy", *COPY_WORDS)
NUMBERS = [str(number) for number in range(300)]
NUMBER_IDS = range(len(SPECIAL_TOKENS) + len(WORDS), len(SPECIAL_TOKENS) + len(WORDS) + len(NUMBERS))  # their ids
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|> {% generation %}{{ message['content'] }} {{ eos_token }}"
    "{% endgeneration %}{% elif message['role'] == 'user' %}<|user|> {{ message['content'] }} "
    "{% else %}{{ raise_exception('unsupported role ' + message['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def task(rng: random.Random) -> tuple[str, list[str]]:
    """One random task: its prompt and its answer words."""
    kind = rng.randrange(4)
    if kind == 0:
        start = rng.randrange(0, 271)
        stop = start + rng.randrange(5, 25)
        return f"count up from {start} to {stop}", [str(n) for n in range(start, stop + 1)]
    if kind == 1:
        start = rng.randrange(30, 300)
        stop = max(0, start - rng.randrange(5, 25))
        return f"count down from {start} to {stop}", [str(n) for n in range(start, stop - 1, -1)]
    if kind == 2:
        start, step, terms = rng.randrange(0, 101), rng.randrange(2, 7), rng.randrange(4, 15)
        stop = start + step * terms
        return f"count from {start} to {stop} by {step}", [str(n) for n in range(start, stop + 1, step)]
    words = rng.sample(COPY_WORDS, rng.randrange(3, 9))
    return f"copy {' '.join(words)}", words


def counting_guess(tokens: list[int], length: int) -> list[int]:
    """At most ``length`` tokens that go on counting from the last two, when both are numbers a step apart: the
    tasks' answers count (``build_tokenizer`` gives the numbers consecutive ids). A guess for decoding to verify
    (``greedy_generate``'s ``guess``); empty when the last two tokens do not count."""
    first, last = NUMBER_IDS.start, NUMBER_IDS.stop - 1
    if length < 1 or len(tokens) < 2 or not (first <= tokens[-2] <= last and first <= tokens[-1] <= last):
        return []
    step = tokens[-1] - tokens[-2]
    if step == 0:
        return []
    stop = first - 1 if step < 0 else last + 1
    return list(range(tokens[-1] + step, stop, step))[:length]


def held_out(prompt: str) -> bool:
    """Whether a task instance belongs to the held-out split: a fixed twentieth of all instances.

    The split is a property of the prompt text (a task instance is fully determined by its
    prompt), so training and validation data drawn with any seeds and counts never share one.
    """
    return hashlib.sha256(prompt.encode()).digest()[0] % 20 == 0


def conversation(rng: random.Random, split: str | None = None) -> dict:
    """One OpenAI ``messages`` sample: a task and its exact answer.

    Args:
        rng: Source of the task.
        split: ``"train"`` or ``"val"`` draws only instances of that split (``held_out``); None
            draws from all instances.
    """
    if split not in (None, "train", "val"):
        raise ValueError(f"split must be None, 'train' or 'val', got {split!r}")
    while True:
        prompt, answer = task(rng)
        if split is None or held_out(prompt) == (split == "val"):
            break
    return {
        "messages": [
            {"role": "user", "content": f"please {prompt}"},
            {"role": "assistant", "content": " ".join(answer)},
        ]
    }


def build_tokenizer():
    """The word-level fast tokenizer of the tiny recipe; ids fit the tiny configs' vocabulary (512)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *WORDS, *NUMBERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "WORDS", "build_tokenizer", "conversation", "held_out", "task"]

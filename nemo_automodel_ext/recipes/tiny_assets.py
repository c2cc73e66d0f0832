"""Offline assets for the tiny CPU distillation recipe: target, tokenizer and chat data.

Nothing is downloaded. ``ensure_tiny_assets(directory)`` writes, once:

- ``target/``: the shipped tiny V4.1 config (``models/deepseek_v41/configs/tiny_target.json``),
  randomly initialised, saved in Hugging Face format (``config.json`` + ``model.safetensors``),
  with a word-level fast tokenizer and chat template built locally with ``tokenizers``;
- ``train.jsonl`` / ``val.jsonl``: OpenAI ``messages`` conversations of predictable tasks
  (counting, arithmetic progressions, repetition) that a draft can learn in minutes.

Run ``python -m nemo_automodel_ext.recipes.tiny_assets DIR`` to build them by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, tiny_target_config

# Fixed ids: the tiny config's bos/eos/pad and its DSpark noise (mask) token.
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<mask>", "<|user|>", "<|assistant|>", "<unk>")
WORDS = (
    "count up down from to by repeat times please and then the list numbers start step "
    "words alpha beta gamma delta echo fox golf hotel india juliet kilo lima"
).split()
NUMBERS = [str(number) for number in range(300)]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|> {% generation %}{{ message['content'] }} {{ eos_token }}"
    "{% endgeneration %}{% else %}<|user|> {{ message['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_MARKER = ".complete"


def _conversation(rng: random.Random) -> dict:
    task = rng.randrange(4)
    if task == 0:
        start = rng.randrange(0, 200)
        stop = start + rng.randrange(6, 40)
        prompt, answer = f"count up from {start} to {stop}", list(range(start, stop + 1))
    elif task == 1:
        start = rng.randrange(40, 299)
        stop = max(0, start - rng.randrange(6, 40))
        prompt, answer = f"count down from {start} to {stop}", list(range(start, stop - 1, -1))
    elif task == 2:
        start, step = rng.randrange(0, 60), rng.randrange(2, 7)
        terms = rng.randrange(6, 20)
        prompt, answer = f"list numbers start {start} step {step}", [start + step * i for i in range(terms)]
    else:
        words = rng.sample(WORDS[-12:], rng.randrange(2, 5))
        times = rng.randrange(3, 8)
        prompt, answer = f"repeat {' '.join(words)} {times} times", words * times
    return {
        "messages": [
            {"role": "user", "content": f"please {prompt}"},
            {"role": "assistant", "content": " ".join(str(token) for token in answer)},
        ]
    }


def build_tokenizer():
    """The word-level fast tokenizer of the tiny recipe; ids fit the tiny config's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *WORDS, *NUMBERS))}
    if len(vocab) >= tiny_target_config().image_token_id:
        raise ValueError("tiny tokenizer vocabulary collides with the image token id")
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


def ensure_tiny_assets(directory: str | os.PathLike, *, seed: int = 0, train_samples: int = 3000) -> Path:
    """Create the tiny recipe's assets under ``directory`` unless they already exist.

    Args:
        directory: Output folder; written atomically (a temporary sibling renamed at the end).
        seed: Seed of the target weights and the generated conversations.
        train_samples: Number of training conversations (validation gets a tenth).

    Returns:
        ``Path(directory)``, holding ``target/``, ``train.jsonl`` and ``val.jsonl``.
    """
    directory = Path(directory)
    if (directory / _MARKER).exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        target_dir = staging / "target"
        target_dir.mkdir()
        model = build_tiny_target(seed=seed)
        model.config.save_pretrained(target_dir)
        save_file(
            {name: tensor.contiguous() for name, tensor in model.state_dict().items()}, target_dir / "model.safetensors"
        )
        build_tokenizer().save_pretrained(target_dir)
        rng = random.Random(seed)
        for name, count in (("train.jsonl", train_samples), ("val.jsonl", max(1, train_samples // 10))):
            with open(staging / name, "w") as handle:
                for _ in range(count):
                    handle.write(json.dumps(_conversation(rng)) + "\n")
        (staging / _MARKER).write_text("ok\n")
        if directory.exists():
            shutil.rmtree(directory)  # an incomplete earlier attempt
        staging.rename(directory)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(ensure_tiny_assets(args.directory, seed=args.seed))


if __name__ == "__main__":
    main()

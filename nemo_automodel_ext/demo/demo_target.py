"""The tiny recipe's demo target: a small DeepSeek V4.1 that solves the synthetic tasks.

A DSpark draft is only worth something if its target's tokens are predictable from the target's
own states; a randomly initialised target emits noise, and a draft trained against it learns the
dataset instead of the target. The demo target is the shipped demo config
(``models/deepseek_v41/configs/demo_target.json``: 6 layers, hidden 64, sliding window 64)
trained on ``tiny_tasks`` conversations until greedy decoding answers held-out prompts exactly.
Its weights ship with the package (``demo/assets/demo_target``); this module is the script
that made them, deterministic for a given seed on one machine:

    python -m nemo_automodel_ext.demo.demo_target --output nemo_automodel_ext/demo/assets/demo_target

It trains with the model's own packed loss (``seq_lens`` + ``labels``, assistant tokens only)
and prints the held-out exact-match rate of greedy decoding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from importlib import resources
from pathlib import Path

import torch
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from safetensors.torch import load_file, save_file

from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer, conversation
from nemo_automodel_ext.evaluation.generate import greedy_generate
from nemo_automodel_ext.evaluation.sequences import encode_conversation
from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, cpu_backend

DEMO_TARGET_CONFIG = "configs/demo_target.json"
SHIPPED_WEIGHTS = "assets/demo_target/model.safetensors"
MAX_NEW_TOKENS = 32


def demo_target_config() -> DeepseekV41Config:
    """The shipped demo target config (``models/deepseek_v41/configs/demo_target.json``)."""
    package = resources.files("nemo_automodel_ext.models.deepseek_v41")
    raw = json.loads(package.joinpath(DEMO_TARGET_CONFIG).read_text())
    raw.pop("model_type")
    return DeepseekV41Config(**raw)


def load_demo_target() -> DeepseekV41ForCausalLM:
    """The trained demo target (fp32, eval mode, CPU) from the weights shipped with the package."""
    model = DeepseekV41ForCausalLM(demo_target_config(), backend=cpu_backend())
    weights = resources.files("nemo_automodel_ext.demo").joinpath(SHIPPED_WEIGHTS)
    with resources.as_file(weights) as path:
        model.load_state_dict(load_file(str(path)), strict=True)
    install_packed_indexer(model)
    return model.float().eval()


def _packed_batch(tokenizer, rng: random.Random, rows: int, width: int, pad: int):
    """Rows of whole conversations; labels are the assistant tokens (-100 elsewhere)."""
    ids = torch.full((rows, width), pad, dtype=torch.long)
    labels = torch.full((rows, width), -100, dtype=torch.long)
    lengths = []
    for row in range(rows):
        used, row_lengths = 0, []
        while True:
            tokens, prompt = encode_conversation(tokenizer, conversation(rng)["messages"])
            if used + len(tokens) > width:
                break
            ids[row, used : used + len(tokens)] = torch.tensor(tokens)
            labels[row, used + prompt : used + len(tokens)] = torch.tensor(tokens[prompt:])
            used += len(tokens)
            row_lengths.append(len(tokens))
        row_lengths.append(width - used)  # trailing padding as its own document
        lengths.append(row_lengths)
    documents = max(map(len, lengths))
    seq_lens = torch.tensor([row + [0] * (documents - len(row)) for row in lengths])
    return ids, labels, seq_lens


def train_demo_target(
    steps: int = 3000, seed: int = 0, rows: int = 16, width: int = 128, lr: float = 3e-3, log_every: int = 100
) -> DeepseekV41ForCausalLM:
    """Train the demo config on fresh ``tiny_tasks`` conversations (AdamW, warmup + cosine).

    Returns:
        The trained fp32 model in eval mode, on CPU.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    # Upstream's indexer, as the shipped weights were trained (the packed one selects the same on tie-free scores).
    model = build_tiny_target(seed=seed, config=demo_target_config(), packed_indexer=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / steps))),
    )
    start = time.perf_counter()
    for step in range(1, steps + 1):
        ids, labels, seq_lens = _packed_batch(tokenizer, rng, rows, width, tokenizer.pad_token_id)
        loss = model(ids, seq_lens=seq_lens, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step % log_every == 0 or step == steps:
            print(f"step {step}/{steps} loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval()


def exact_match(model: DeepseekV41ForCausalLM, samples: list[dict]) -> float:
    """Fraction of conversations whose greedy continuation equals the reference answer (EOS included)."""
    tokenizer = build_tokenizer()
    encoded = [encode_conversation(tokenizer, sample["messages"]) for sample in samples]
    prompts = [tokens[:prompt] for tokens, prompt in encoded]
    generated = greedy_generate(model, prompts, MAX_NEW_TOKENS, tokenizer.eos_token_id)
    return sum(out == tokens[prompt:] for out, (tokens, prompt) in zip(generated, encoded)) / len(samples)


def save_target(model: DeepseekV41ForCausalLM, directory: str | Path) -> str:
    """Write ``model.safetensors`` under ``directory``; returns its sha256."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for model.safetensors")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", type=int, default=500, help="held-out prompts for the exact-match rate")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = train_demo_target(steps=args.steps, seed=args.seed)
    digest = save_target(model, args.output)
    heldout = random.Random(10_000 + args.seed)
    rate = exact_match(model, [conversation(heldout) for _ in range(args.heldout)])
    print(f"wrote {args.output}/model.safetensors sha256={digest}")
    print(f"greedy exact match on {args.heldout} held-out prompts: {rate:.1%}")


if __name__ == "__main__":
    main()

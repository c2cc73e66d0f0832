"""Where upstream's own V4.1 forward departs from the plugin's greedy text, on the demo target.

Run: ``.venv/bin/python benchmarks/upstream_departure.py [--prompts 32] [--new-tokens 64]``

The plugin runs every target forward through the packed path with its indexer (``packed_indexer.py``:
ties to the lower key index, so a column's logits do not depend on later tokens). Upstream's unpacked
forward (``model(input_ids)``, its ``_Indexer``) keeps ``torch.topk``'s width-dependent ties. This decodes
``--prompts`` held-out demo prompts greedily with the plugin (``greedy_generate``), runs upstream's unpacked
forward once over each ``prompt + continuation``, and reports the first generated position whose upstream
argmax differs from the plugin's token: how many sequences depart, and where (tokens after the prompt, and
sequence length there). docs/evaluation.md quotes its output.
"""

from __future__ import annotations

import argparse
import copy
import random

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from nemo_automodel.components.models.deepseek_v41 import attention as upstream_attention

    from nemo_automodel_ext.demo.demo_target import load_demo_target
    from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer, conversation
    from nemo_automodel_ext.evaluation.generate import greedy_generate
    from nemo_automodel_ext.evaluation.sequences import encode_conversation

    plugin = load_demo_target()
    upstream = copy.deepcopy(plugin)
    for module in upstream.modules():  # back to upstream's indexer
        if isinstance(module, upstream_attention._Indexer):
            module.__class__ = upstream_attention._Indexer
    tokenizer = build_tokenizer()
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.prompts):
        messages = conversation(rng, "val")["messages"]
        ids, prompt_length = encode_conversation(tokenizer, messages)
        prompts.append(ids[:prompt_length])
    continuations = greedy_generate(plugin, prompts, args.new_tokens, eos_token_id=None)
    departures = []
    with torch.no_grad():
        for prompt, continuation in zip(prompts, continuations):
            ids = torch.tensor([prompt + continuation])
            greedy = upstream(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            differs = (greedy != torch.tensor(continuation)).nonzero()
            if len(differs):
                first = int(differs[0])
                departures.append((first, len(prompt) + first))
    lengths = [len(p) for p in prompts]
    print(
        f"{args.prompts} held-out demo prompts ({min(lengths)}-{max(lengths)} tokens), {args.new_tokens} greedy tokens "
        f"each: upstream's unpacked forward departs from the plugin's greedy text on {len(departures)}"
    )
    for first, at in sorted(departures):
        print(f"  at generated token {first + 1} (sequence position {at})")


if __name__ == "__main__":
    main()

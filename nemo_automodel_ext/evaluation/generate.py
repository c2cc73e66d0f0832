"""Greedy continuations of a V4.1 target, for data regeneration and acceptance evaluation.

The V4.1 training model has no KV cache, so every step re-runs the rows (``causal_logits``: the packed
path, prefix-consistent, as the capture and the replay see the target); prompts of one length
decode together in lockstep, so no row needs padding. Meant for small targets (the tiny recipe,
tests); a Flash-sized target regenerates its data through a serving engine (``docs/recipes.md``).

A guessed continuation (a dataset answer the target probably reproduces) is verified with one
forward, as speculative decoding verifies a draft: its longest prefix that the target's argmax
follows is kept, plus the target's own token where they part, and only the rest is decoded. The
result is the same greedy text; the cost falls from one forward per token to one per sequence.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn as nn

from nemo_automodel_ext.models.deepseek_v41.dspark_target import prepare_packed_inputs
from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer


@torch.no_grad()
def causal_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a V4.1 target on whole rows, each row one document, through the packed path.

    The packed path uses the plugin's indexer selection (``selection.py``), whose ties do not
    depend on the row width, so column t's logits depend on tokens 0..t only: the same logits
    the capture, the acceptance replay and round-by-round decoding see.

    Args:
        model: ``DeepseekV41ForCausalLM``; its indexers are switched to the segmented selection.
        input_ids: Token ids [batch, sequence].

    Returns:
        New logits [batch, sequence, vocab].
    """
    install_packed_indexer(model)
    lengths = torch.full((input_ids.shape[0], 1), input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    layout, inputs = prepare_packed_inputs(model, input_ids, lengths)
    return layout.restore(model(**inputs).logits)


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | None,
    max_batch_tokens: int = 16384,
    guesses: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Decode each prompt greedily with ``model``.

    Args:
        model: ``DeepseekV41ForCausalLM``, run through the packed path (``causal_logits``).
        prompts: Token ids of each prompt (non-empty).
        max_new_tokens: Most tokens generated per prompt (positive).
        eos_token_id: Generation of a prompt stops after this token (kept); None: never.
        max_batch_tokens: Rows decoded together are capped so rows x final length stays below this.
        guesses: Optional guessed continuation of each prompt, verified first (see the module).

    Returns:
        One list of generated token ids per prompt, in order, ending at the first EOS inclusive
        or after ``max_new_tokens``. The model's state is not changed.

    Raises:
        ValueError: for an empty prompt list entry, a non-positive ``max_new_tokens`` or a
            ``guesses`` list of another length.
    """
    if guesses is not None:
        if len(guesses) != len(prompts):
            raise ValueError(f"guesses has {len(guesses)} entries for {len(prompts)} prompts")
        return _verify_guesses(model, prompts, guesses, max_new_tokens, eos_token_id, max_batch_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{index}] is empty: a continuation needs at least one prompt token")
        by_length[len(prompt)].append(index)
    device = next(model.parameters()).device
    results: list[list[int]] = [[] for _ in prompts]
    for length, indices in by_length.items():
        rows_per_chunk = max(1, max_batch_tokens // (length + max_new_tokens))
        for begin in range(0, len(indices), rows_per_chunk):
            chunk = indices[begin : begin + rows_per_chunk]
            ids = torch.tensor([list(prompts[i]) for i in chunk], dtype=torch.long, device=device)
            finished = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                step = causal_logits(model, ids)[:, -1].argmax(dim=-1)
                ids = torch.cat((ids, step.unsqueeze(1)), dim=1)
                if eos_token_id is not None:
                    finished |= step == eos_token_id
                    if bool(finished.all()):
                        break
            for row, index in enumerate(chunk):
                generated = ids[row, length:].tolist()
                if eos_token_id is not None and eos_token_id in generated:
                    generated = generated[: generated.index(eos_token_id) + 1]
                results[index] = generated
    return results


def _verify_guesses(model, prompts, guesses, max_new_tokens, eos_token_id, max_batch_tokens) -> list[list[int]]:
    """``greedy_generate`` with each guess verified by one forward; only the unverified rest is decoded."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, (prompt, guess) in enumerate(zip(prompts, guesses)):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{index}] is empty: a continuation needs at least one prompt token")
        by_length[len(prompt) + min(len(guess), max_new_tokens)].append(index)
    device = next(model.parameters()).device
    verified: list[list[int]] = [[] for _ in prompts]
    for length, indices in by_length.items():
        rows_per_chunk = max(1, max_batch_tokens // length)
        for begin in range(0, len(indices), rows_per_chunk):
            chunk = indices[begin : begin + rows_per_chunk]
            rows = [[*prompts[i], *guesses[i][:max_new_tokens]] for i in chunk]
            predicted = (
                causal_logits(model, torch.tensor(rows, dtype=torch.long, device=device)).argmax(dim=-1).tolist()
            )
            for row, index in enumerate(chunk):
                start, guess = len(prompts[index]), rows[row][len(prompts[index]) :]
                tokens = []
                for offset in range(len(guess) + 1):
                    tokens.append(predicted[row][start - 1 + offset])
                    if offset == len(guess) or tokens[-1] != guess[offset] or tokens[-1] == eos_token_id:
                        break
                verified[index] = tokens[:max_new_tokens]
    unfinished = [i for i, tokens in enumerate(verified) if len(tokens) < max_new_tokens and tokens[-1] != eos_token_id]
    if unfinished:
        rest = greedy_generate(
            model,
            [[*prompts[i], *verified[i]] for i in unfinished],
            max_new_tokens,
            eos_token_id,
            max_batch_tokens,
        )
        for i, tokens in zip(unfinished, rest):
            verified[i] = [*verified[i], *tokens][:max_new_tokens]
    return verified


__all__ = ["causal_logits", "greedy_generate"]

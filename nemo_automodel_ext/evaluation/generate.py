"""Greedy continuations of a V4.1 target, for data regeneration and acceptance evaluation.

The V4.1 training model has no KV cache, so every step re-runs the sequences through the packed path
(``packed_predictions``: prefix-consistent, as the capture and the replay see the target); sequences of
any lengths run together as documents of shared rows, each row sized to its members' length class and cut
to its batch's fullest row.
Meant for small targets (the tiny recipe, tests); a Flash-sized target regenerates its data through a
serving engine (``docs/recipes.md``).

A guessed continuation (a dataset answer the target probably reproduces) is verified with one
forward, as speculative decoding verifies a draft: its longest prefix that the target's argmax
follows is kept, plus the target's own token where they part, and only the rest is decoded. The
result is the same greedy text; the cost falls from one forward per token to one per sequence.
Without a dataset guess, decoding guesses for itself (``lookup_guess``, Jacobi decoding).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from nemo_automodel_ext.evaluation.sequences import EvalSequence, pack_sequences
from nemo_automodel_ext.models.deepseek_v41.dspark_target import prepare_packed_inputs
from nemo_automodel_ext.models.deepseek_v41.length_classes import class_widths
from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer

Guesser = Callable[[Sequence[int], int], list[int]]  # (tokens so far, most tokens) -> the tokens guessed next


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
def packed_predictions(
    model: nn.Module, sequences: Sequence[Sequence[int]], width: int = 2048, max_batch_tokens: int = 16384
) -> list[list[int]]:
    """The target's greedy next token after every prefix of each sequence, many sequences a row.

    Sequences of any lengths share packed rows (``pack_sequences``, longest first), each its own
    document of the packed path, so one forward verifies them all: column t of a sequence depends on
    its tokens 0..t only, as in ``causal_logits`` on the sequence alone. A sequence goes into rows of
    its length class (``length_classes.class_widths``: the power of two at or above it, at least 64, at most
    ``width``),
    so short sequences never share a wide row: the eager attention's cost a token grows with the row's
    width (a dense [row, row] score a head), and a class row is at most twice its longest member.

    Args:
        model: ``DeepseekV41ForCausalLM``; its indexers are switched to the segmented selection.
        sequences: Token ids of each sequence (non-empty).
        width: Widest packed row; a longer sequence gets a row of its own.
        max_batch_tokens: Rows run together are capped at this many tokens (at least one row).

    Returns:
        New lists, one a sequence in order: entry t is the argmax of the logits at its token t.

    Raises:
        ValueError: for an empty sequence.
    """
    install_packed_indexer(model)
    device = next(model.parameters()).device
    pad = model.config.text_config.pad_token_id or 0
    for index, sequence in enumerate(sequences):
        if len(sequence) == 0:
            raise ValueError(f"sequences[{index}] is empty")
    widths = class_widths(torch.tensor([len(sequence) for sequence in sequences], dtype=torch.long), width).tolist()
    classes: dict[int, list[int]] = defaultdict(list)
    for index in sorted(range(len(sequences)), key=lambda index: -len(sequences[index])):
        classes[widths[index]].append(index)
    predicted: list[list[int]] = [[] for _ in sequences]
    for class_width, members in classes.items():
        packed = [EvalSequence(tuple(sequences[index])) for index in members]
        for batch in pack_sequences(packed, class_width, max(1, max_batch_tokens // class_width), pad, trim=True):
            layout, inputs = prepare_packed_inputs(model, batch["input_ids"].to(device), batch["seq_lens"].to(device))
            rows = layout.restore(model(**inputs).logits).argmax(dim=-1).tolist()
            for row, (lengths, slots) in enumerate(zip(batch["seq_lens"].tolist(), batch["sequence_index"].tolist())):
                column = 0
                for length, slot in zip(lengths, slots):
                    if slot >= 0:
                        predicted[members[slot]] = rows[row][column : column + length]
                    column += length
    return predicted


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | None,
    max_batch_tokens: int = 16384,
    guesses: Sequence[Sequence[int]] | None = None,
    guess: Guesser | None = None,
) -> list[list[int]]:
    """Decode each prompt greedily with ``model``.

    Every step runs all unfinished sequences at once, prompts of any lengths packed as documents of
    shared rows (``packed_predictions``), so a batch of distinct lengths costs one forward a step, not
    one a step and length. Each step also verifies a guess of every sequence's next tokens (``follow_guess``),
    as speculative decoding verifies a draft's: ``guess``'s (by default ``lookup_guess``: where the sequence's
    last tokens occurred before, a copy or a loop), else the last step's argmax past what it verified (Jacobi
    decoding). A step commits at least one token, and as many as the target confirms; the text is plain greedy
    decoding's whatever the guesses.

    Args:
        model: ``DeepseekV41ForCausalLM``, run through the packed path (``packed_predictions``).
        prompts: Token ids of each prompt (non-empty).
        max_new_tokens: Most tokens generated per prompt (positive).
        eos_token_id: Generation of a prompt stops after this token (kept); None: never.
        max_batch_tokens: Rows run together are capped at this many tokens.
        guesses: Optional guessed continuation of each prompt, verified first (see the module).
        guess: ``guess(tokens, length)``: at most ``length`` tokens guessed to follow ``tokens`` at every step;
            default ``lookup_guess``.

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
        return _verify_guesses(model, prompts, guesses, max_new_tokens, eos_token_id, max_batch_tokens, guess)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{index}] is empty: a continuation needs at least one prompt token")
    return _decode(model, prompts, [max_new_tokens] * len(prompts), eos_token_id, max_batch_tokens, guess)


def _decode(model, prompts, budgets, eos_token_id, max_batch_tokens, guess: Guesser | None) -> list[list[int]]:
    """``greedy_generate``'s loop: each prompt decoded to its EOS or its own budget of new tokens."""
    guess = guess or lookup_guess
    results: list[list[int]] = [[] for _ in prompts]
    guesses_next: list[list[int]] = [[] for _ in prompts]  # the last forward's predictions past what it verified
    active = [index for index, budget in enumerate(budgets) if budget > 0]
    while active:
        contexts, guessed = [], []
        for index in active:
            context, left = [*prompts[index], *results[index]], budgets[index] - len(results[index])
            guessed.append((guess(context, left - 1) or guesses_next[index])[: left - 1])
            contexts.append(context)
        rows = packed_predictions(
            model,
            [[*context, *tokens] for context, tokens in zip(contexts, guessed)],
            max_batch_tokens=max_batch_tokens,
        )
        for index, context, guessed_tokens, row in zip(active, contexts, guessed, rows):
            left = budgets[index] - len(results[index])
            tokens = follow_guess(row, len(context), guessed_tokens, left, eos_token_id)
            results[index] += tokens
            guesses_next[index] = row[len(context) + len(tokens) - 1 :]  # Jacobi: each next column's argmax
        active = [index for index in active if not is_finished(results[index], budgets[index], eos_token_id)]
    return results


def lookup_guess(tokens: Sequence[int], length: int, ngram: int = 3) -> list[int]:
    """What would follow ``tokens`` if it went on as after the latest earlier occurrence of its last words.

    Prompt-lookup decoding's guess: the longest suffix of at most ``ngram`` tokens that also occurs earlier is
    matched at its latest earlier occurrence, and the tokens after that occurrence are copied, overlapping into
    the copy itself, so a repeating cycle continues past the end. A guess only saves forwards when it is right;
    ``follow_guess`` keeps what the target confirms.

    Args:
        tokens: The sequence so far (token ids).
        length: Most tokens to guess.
        ngram: Longest suffix matched.

    Returns:
        A new list of at most ``length`` tokens; empty when no suffix recurs or ``length`` < 1.
    """
    if length < 1:
        return []
    for size in range(min(ngram, len(tokens) - 1), 0, -1):
        suffix = list(tokens[-size:])
        for end in range(len(tokens) - 1, size - 1, -1):
            if list(tokens[end - size : end]) == suffix:
                extended = list(tokens)
                for offset in range(length):
                    extended.append(extended[end + offset])
                return extended[len(tokens) :]
    return []


def follow_guess(
    predicted: Sequence[int], start: int, guess: Sequence[int], max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """The target's greedy continuation after ``start`` tokens, as far as one forward over a guess shows it.

    Args:
        predicted: The target's argmax after each prefix of ``prompt + guess`` (``packed_predictions``).
        start: Prompt tokens (positive).
        guess: The guessed continuation that was run after the prompt.
        max_new_tokens: Most tokens a continuation has.
        eos_token_id: A continuation ends after this token (kept); None: never.

    Returns:
        A new list: the longest prefix of ``guess`` the target follows, plus the target's own token where they
        part (or after the guess), at most ``max_new_tokens``. It is the whole greedy continuation when
        ``is_finished`` says so; otherwise ``finish_greedy`` decodes the rest.
    """
    guess = guess[:max_new_tokens]
    tokens = []
    for offset in range(len(guess) + 1):
        tokens.append(predicted[start - 1 + offset])
        if offset == len(guess) or tokens[-1] != guess[offset] or tokens[-1] == eos_token_id:
            break
    return tokens[:max_new_tokens]


def is_finished(tokens: Sequence[int], max_new_tokens: int, eos_token_id: int | None) -> bool:
    """Whether a greedy continuation is complete: ``max_new_tokens`` long, or ending with the EOS token."""
    return len(tokens) >= max_new_tokens or (eos_token_id is not None and tokens[-1] == eos_token_id)


def finish_greedy(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    started: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | None,
    max_batch_tokens: int = 16384,
    guess: Guesser | None = None,
) -> list[list[int]]:
    """Each prompt's greedy continuation, given its first tokens (``started``, from ``follow_guess``); ``guess`` as
    in ``greedy_generate``.

    Returns:
        New lists, in order: ``started`` itself where it is finished, else decoded on from it to the EOS or
        ``max_new_tokens`` in all.
    """
    finished = [list(tokens) for tokens in started]
    unfinished = [i for i, tokens in enumerate(finished) if not is_finished(tokens, max_new_tokens, eos_token_id)]
    if unfinished:
        rest = _decode(
            model,
            [[*prompts[i], *finished[i]] for i in unfinished],
            [max_new_tokens - len(finished[i]) for i in unfinished],
            eos_token_id,
            max_batch_tokens,
            guess,
        )
        for i, tokens in zip(unfinished, rest):
            finished[i] += tokens
    return finished


def _verify_guesses(model, prompts, guesses, max_new_tokens, eos_token_id, max_batch_tokens, guess) -> list[list[int]]:
    """``greedy_generate`` with each guess verified by one forward; only the unverified rest is decoded."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{index}] is empty: a continuation needs at least one prompt token")
    rows = packed_predictions(
        model,
        [[*prompt, *planned[:max_new_tokens]] for prompt, planned in zip(prompts, guesses)],
        max_batch_tokens=max_batch_tokens,
    )
    verified = [
        follow_guess(row, len(prompt), planned, max_new_tokens, eos_token_id)
        for row, prompt, planned in zip(rows, prompts, guesses)
    ]
    return finish_greedy(model, prompts, verified, max_new_tokens, eos_token_id, max_batch_tokens, guess)


__all__ = [
    "causal_logits",
    "finish_greedy",
    "follow_guess",
    "greedy_generate",
    "is_finished",
    "lookup_guess",
    "packed_predictions",
]

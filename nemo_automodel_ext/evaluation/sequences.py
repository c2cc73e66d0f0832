"""Prompt + continuation pairs as packed rows, in the training batch format.

The evaluator replays the target's continuation of each prompt. ``pack_sequences`` lays pairs
out as documents of packed rows exactly as the recipe's dataloader does (``input_ids``,
``loss_mask`` on the continuation, ``attention_mask``, document-local ``position_ids``,
``doc_remaining``, ``seq_lens`` with trailing padding as its own document), so evaluation
captures features through the same packed target path as training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_automodel_ext.run.data_checks import is_local_chat_file, read_chat_samples


@dataclass(frozen=True)
class EvalSequence:
    """One prompt and a continuation of it (the target's greedy text, or a dataset answer).

    Attributes:
        prompt: Prompt token ids (the chat template's generation prompt included).
        continuation: Continuation token ids; may be empty.
    """

    prompt: tuple[int, ...]
    continuation: tuple[int, ...] = ()


def pack_sequences(
    sequences: Sequence[EvalSequence], width: int, rows_per_batch: int, pad_token_id: int, trim: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Pack sequences in order, first fit, into rows of ``width`` columns.

    Args:
        sequences: Pairs to lay out; each is one document (prompt then continuation).
        width: Row width; a longer sequence gets a row of its own, as wide as it.
        rows_per_batch: Rows per returned batch.
        pad_token_id: Token filling the trailing padding document of each row.
        trim: Cut each batch's rows to its fullest row's tokens (never wider than ``width`` unless a sequence is):
            a batch of a few short sequences does not run ``width`` columns of padding.

    Returns:
        Batches of new tensors [rows, width] (``seq_lens``: [rows, documents]) plus
        ``sequence_index`` [rows, documents] (the position of each document in ``sequences``,
        -1 for padding), in the recipe's packed batch format. Documents keep ``sequences`` order.
    """
    rows: list[list[int]] = []
    used: list[int] = []
    for index, sequence in enumerate(sequences):
        length = len(sequence.prompt) + len(sequence.continuation)
        if length == 0:
            raise ValueError(f"sequences[{index}] is empty")
        if rows and used[-1] + length <= width:
            rows[-1].append(index)
            used[-1] += length
        else:
            rows.append([index])
            used.append(length)
    batches = []
    for begin in range(0, len(rows), rows_per_batch):
        chunk = rows[begin : begin + rows_per_batch]
        row_width = max(0 if trim else width, *used[begin : begin + rows_per_batch])
        documents = max(len(row) for row in chunk) + 1
        fields = {
            name: torch.zeros(len(chunk), row_width, dtype=torch.long)
            for name in ("input_ids", "loss_mask", "attention_mask", "position_ids", "doc_remaining")
        }
        fields["input_ids"].fill_(pad_token_id)
        seq_lens = torch.zeros(len(chunk), documents, dtype=torch.long)
        sequence_index = torch.full((len(chunk), documents), -1, dtype=torch.long)
        for row, members in enumerate(chunk):
            column = 0
            for slot, index in enumerate(members):
                tokens = [*sequences[index].prompt, *sequences[index].continuation]
                end = column + len(tokens)
                fields["input_ids"][row, column:end] = torch.tensor(tokens)
                fields["loss_mask"][row, column + len(sequences[index].prompt) : end] = 1
                fields["attention_mask"][row, column:end] = 1
                fields["position_ids"][row, column:end] = torch.arange(len(tokens))
                fields["doc_remaining"][row, column:end] = torch.arange(len(tokens) - 1, -1, -1)
                seq_lens[row, slot], sequence_index[row, slot] = len(tokens), index
                column = end
            if column < row_width:  # trailing padding as its own document
                seq_lens[row, len(members)] = row_width - column
                fields["position_ids"][row, column:] = torch.arange(row_width - column)
        batches.append({**fields, "seq_lens": seq_lens, "sequence_index": sequence_index})
    return batches


def as_packed_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch in the packed-row format, whether the loader packed it or not.

    An unpacked loader (``packed_sequence_size: 0``) yields one right-padded conversation a row
    without ``seq_lens``, ``position_ids`` or ``doc_remaining``; each row becomes one document spanning
    the row (the trailing padding folded into it, as upstream's packing folds a row's last padding).

    Args:
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` [rows, row]; packed batches also carry
            ``seq_lens`` [rows, documents], ``position_ids`` and ``doc_remaining`` [rows, row].

    Returns:
        ``batch`` itself when packed, else a new dict adding ``seq_lens`` [rows, 1] (the row width),
        ``position_ids`` [rows, row] (0, 1, ...) and ``doc_remaining`` [rows, row] (real tokens after
        each column). The caller's tensors are not modified.

    Raises:
        ValueError: when an unpacked row's attention mask is not one run of ones from column 0.
    """
    if "seq_lens" in batch:
        return batch
    mask = batch["attention_mask"]
    rows, width = mask.shape
    columns = torch.arange(width, device=mask.device).expand(rows, width)
    real = mask.sum(dim=1, keepdim=True)
    if not torch.equal(mask.bool(), columns < real):
        raise ValueError("an unpacked batch's attention_mask must be right-padded (ones, then zeros) in every row")
    return {
        **batch,
        "seq_lens": torch.full((rows, 1), width, dtype=torch.long, device=mask.device),
        "position_ids": columns.clone(),
        "doc_remaining": (real - 1 - columns).clamp_min(0),
    }


def read_eval_sequences(path: str | Path, tokenizer, limit: int | None = None) -> list[EvalSequence]:
    """Prompts and reference answers of an OpenAI ``messages`` JSONL (the last assistant turn).

    Args:
        path: JSONL file, one ``{"messages": [...]}`` per line, the last message the assistant's.
        tokenizer: Tokenizer with the target's chat template.
        limit: Read at most this many samples.

    Returns:
        One EvalSequence per sample: the chat-template prompt up to the generation prompt, and the
        assistant turn's tokens as the continuation.

    Raises:
        ValueError: naming the file and line for malformed JSON, a sample without ``messages``,
            a last message that is not the assistant's, or a prompt that renders empty.
    """
    if Path(path).is_dir():
        raise ValueError(f"{path} is a folder; pass a JSON or JSONL file of conversations")
    if not is_local_chat_file(path):
        raise ValueError(f"{path} does not exist (or is not a local JSON/JSONL file)")
    sequences = []
    for where, messages in read_chat_samples(path):
        if limit is not None and len(sequences) >= limit:
            break
        if messages[-1].get("role") != "assistant":
            raise ValueError(f"{where}: needs a 'messages' list ending with an assistant turn")
        try:
            full, prompt = encode_conversation(tokenizer, messages)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        except Exception as error:  # the chat template's own refusal (jinja2), as the training check reports it
            raise ValueError(f"{where}: the chat template rejects this conversation ({error})") from None
        sequences.append(EvalSequence(tuple(full[:prompt]), tuple(full[prompt:])))
    return sequences


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """Token ids of a conversation and the length of its prompt (all but the last turn, plus the
    generation prompt).

    Raises:
        ValueError: when the prompt renders empty or not as a prefix of the whole conversation.
    """
    full = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True)
    prompt = list(prompt["input_ids"])
    if not prompt or full[: len(prompt)] != prompt:
        raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
    return full, len(prompt)


__all__ = ["EvalSequence", "as_packed_rows", "encode_conversation", "pack_sequences", "read_eval_sequences"]

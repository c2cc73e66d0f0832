"""Chat data checks of the packed V4.1 DSpark recipe, before any training step.

Upstream's ``ChatDataset`` fails late and without coordinates on bad data (a malformed JSONL
line surfaces as ``JSONDecodeError: Expecting property name ... line 1 column 2``, naming neither
the file nor its line). ``check_chat_data`` reads a local file once, exactly as upstream's loader will (JSON Lines for
``.jsonl``/``.ndjson`` in any case, one JSON document otherwise; OpenAI ``messages`` or ShareGPT
``conversations``), renders every conversation with the tokenizer's chat template, and raises a
ValueError naming the file, the line (JSONL) or sample index (JSON array) and the rule broken:

- malformed JSON (JSON Lines in a ``.json`` file, a raw U+2028 that upstream's line split cuts);
- a sample with neither a ``messages`` nor a ``conversations`` list;
- an empty conversation;
- no assistant turn (nothing to supervise);
- a message the chat template rejects (an unknown role, a missing ``content``);
- a token id outside the target's vocabulary;
- data whose every assistant token is truncated away.

A sample longer than the row is **truncated** (upstream's ``ChatDataset(truncation=True)``), and
counted: ``DataReport.truncated``, logged by the recipe. Hub datasets and other formats are left
to upstream's loader.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_automodel.components.datasets.llm.chat_dataset import _conversations_to_messages, _normalize_messages

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataReport:
    """What ``check_chat_data`` found in one file.

    Attributes:
        path: The file.
        samples: Conversations in it.
        truncated: Conversations longer than the row (truncated at load time).
        longest: Tokens of the longest conversation.
    """

    path: str
    samples: int
    truncated: int
    longest: int


JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")  # upstream's _load_openai_messages, case-insensitive
#: Characters ``str.splitlines`` (and so upstream's JSONL reader) splits at, which JSON allows raw in strings.
_EXTRA_LINE_BREAKS = {
    "\x0b": "U+000B",
    "\x0c": "U+000C",
    "\x1c": "U+001C",
    "\x1d": "U+001D",
    "\x1e": "U+001E",
    "\x85": "U+0085",
    "\u2028": "U+2028",
    "\u2029": "U+2029",
}


def is_local_chat_file(path: str | Path) -> bool:
    """Whether upstream's loader parses ``path`` itself as JSON/JSONL (not a hub id, Parquet or folder)."""
    path = Path(path)
    return path.is_file() and path.suffix.lower() != ".parquet"


def _rows(path: Path):
    """(where, row) of a local file, parsed exactly as upstream's ``_load_openai_messages`` parses it.

    JSON Lines (``.jsonl``/``.ndjson``, any case) are split with ``str.splitlines``; any other
    file is one JSON document: an array of rows or a single row.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    if path.suffix.lower() in JSON_LINES_SUFFIXES:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as error:
                breaks = [name for char, name in _EXTRA_LINE_BREAKS.items() if char in text]
                hint = (
                    f"; the file holds a raw {breaks[0]} inside a string, where upstream's JSONL reader "
                    "(str.splitlines) splits lines: write it escaped (ensure_ascii=True)"
                    if breaks
                    else ""
                )
                raise ValueError(f"{path}:{number}: malformed JSON ({error.msg}, column {error.colno}){hint}") from None
        return
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        hint = ""
        if error.msg == "Extra data":
            hint = "; it looks like JSON Lines, which upstream reads only from .jsonl or .ndjson files: rename it"
        raise ValueError(f"{path}:{error.lineno}: malformed JSON ({error.msg}, column {error.colno}){hint}") from None
    if isinstance(document, list):
        yield from ((f"{path}[{index}]", row) for index, row in enumerate(document))
    else:
        yield f"{path}", document


def read_chat_samples(path: str | Path):
    """The conversations of a local chat file as upstream's ``ChatDataset`` reads them.

    A row holds OpenAI ``messages`` or ShareGPT ``conversations`` (converted by upstream's own
    ``_conversations_to_messages``); messages are normalised by upstream's ``_normalize_messages``.

    Args:
        path: A local JSON or JSONL file (``is_local_chat_file``).

    Yields:
        ``(where, messages)``: ``path:line`` (JSONL) or ``path[index]`` (JSON array) and the
        normalised message list.

    Raises:
        ValueError: naming the file and line or index: malformed JSON, a row with neither list,
            an empty conversation, a message that is not an object, a conversion upstream refuses.
    """
    for where, row in _rows(Path(path)):
        messages = row.get("messages") if isinstance(row, dict) else None
        if messages is None and isinstance(row, dict) and row.get("conversations") is not None:
            try:
                messages = _conversations_to_messages(row["conversations"])
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
        if not isinstance(messages, list):
            raise ValueError(
                f"{where}: a sample needs a 'messages' list (OpenAI chat format) or a 'conversations' list (ShareGPT)"
            )
        if not messages:
            raise ValueError(f"{where}: empty conversation ('messages' is [])")
        if not all(isinstance(message, dict) for message in messages):
            raise ValueError(f"{where}: every message must be an object with 'role' and 'content'")
        try:
            yield where, _normalize_messages(messages)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{where}: {error}") from None


def check_chat_data(path: str | Path, tokenizer, max_length: int, vocab_size: int, key: str) -> DataReport | None:
    """Check every conversation of a local chat file (see the module); None for hub ids and other formats.

    Args:
        path: ``train_data_path`` / ``val_data_path`` of the recipe.
        tokenizer: The target's tokenizer, chat template applied.
        max_length: Row length a sample is truncated to (``packed_sequence_size`` or ``seq_length``).
        vocab_size: The target's vocabulary size.
        key: The config key naming the file, for messages.

    Returns:
        DataReport of the file, or None when upstream's loader does not parse ``path`` itself
        (a hub id, a Parquet file or dataset folder).

    Raises:
        ValueError: naming the file and line (or sample index) and the rule broken; also for a
            missing file, one without any conversation, and data whose every supervised
            (assistant) token lies past ``max_length`` (nothing would be trained).
    """
    path = Path(path)
    if not is_local_chat_file(path):
        if path.suffix.lower() in (".json", *JSON_LINES_SUFFIXES) and not path.exists():
            raise ValueError(f"{key}: {path} does not exist")
        return None
    samples = truncated = longest = supervised = kept = 0
    for where, messages in read_chat_samples(path):
        if not any(message.get("role") == "assistant" for message in messages):
            raise ValueError(f"{where}: no assistant turn, so nothing to supervise")
        try:
            rendered = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as error:  # jinja2's TemplateError, or a KeyError/TypeError from a malformed message
            raise ValueError(f"{where}: the chat template rejects this conversation ({error})") from None
        ids = rendered["input_ids"]
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(f"{where}: token id {outside[0]} is outside the target's vocabulary [0, {vocab_size})")
        mask = rendered.get("assistant_masks") or []
        supervised += sum(mask)
        kept += sum(mask[:max_length])
        samples += 1
        truncated += len(ids) > max_length
        longest = max(longest, len(ids))
    if samples == 0:
        raise ValueError(f"{key}: {path} holds no conversation")
    if supervised and not kept:
        raise ValueError(
            f"{key}: {path}: every assistant token lies past the {max_length}-token row (rows are truncated to "
            "recipe_args.packed_sequence_size, or seq_length when unpacked), so nothing would be trained; "
            "raise the row length"
        )
    return DataReport(str(path), samples, truncated, longest)


def check_recipe_data(args: dict[str, Any], tokenizer, row: int, vocab_size: int) -> None:
    """``check_chat_data`` on the recipe's train and validation files; warns with the truncated count."""
    for key in ("train_data_path", "val_data_path"):
        if args[key] is None:
            continue
        report = check_chat_data(args[key], tokenizer, row, vocab_size, f"recipe_args.{key}")
        if report is not None and report.truncated:
            logger.warning(
                "%s: %d of %d conversations are longer than the %d-token row (longest %d) and are truncated",
                report.path,
                report.truncated,
                report.samples,
                row,
                report.longest,
            )


def require_a_batch_per_rank(args: dict[str, Any], rows: int, ranks: int) -> None:
    """Refuse training data with fewer rows (packed rows, or samples) than data-parallel ranks.

    Upstream's ``DistributedSampler`` would otherwise repeat samples to fill the ranks.
    """
    if rows < ranks:
        raise ValueError(
            f"recipe_args.train_data_path={args['train_data_path']} gives {rows} training rows, fewer than the "
            f"{ranks} data-parallel ranks: every rank needs at least one batch; add data or use fewer ranks"
        )


__all__ = [
    "DataReport",
    "check_chat_data",
    "check_recipe_data",
    "is_local_chat_file",
    "read_chat_samples",
    "require_a_batch_per_rank",
]

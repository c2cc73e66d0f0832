"""Chat data checks of the packed V4.1 DSpark recipe, before any training step.

Upstream's ``ChatDataset`` fails late and without coordinates on bad data (a malformed JSONL
line surfaces as ``JSONDecodeError: Expecting property name ... line 1 column 2``, naming neither
the file nor its line). ``check_chat_data`` reads a local JSON/JSONL file once, renders every
conversation with the tokenizer's chat template, and raises a ValueError naming the file, the
line (JSONL) or sample index (JSON array) and the rule broken:

- malformed JSON;
- a sample that is not an object with a ``messages`` list;
- an empty conversation;
- no assistant turn (nothing to supervise);
- a message the chat template rejects (an unknown role, a missing ``content``);
- a token id outside the target's vocabulary.

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


def _samples(path: Path):
    """(where, sample) of a JSONL file (``path:line``) or a JSON array file (``path[index]``)."""
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{error.lineno}: malformed JSON ({error.msg}, column {error.colno})") from None
        yield from ((f"{path}[{index}]", item) for index, item in enumerate(items))
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: malformed JSON ({error.msg}, column {error.colno})") from None


def check_chat_data(path: str | Path, tokenizer, max_length: int, vocab_size: int, key: str) -> DataReport | None:
    """Check every conversation of a local chat file (see the module); None for hub ids and other formats.

    Args:
        path: ``train_data_path`` / ``val_data_path`` of the recipe.
        tokenizer: The target's tokenizer, chat template applied.
        max_length: Row length a sample is truncated to (``packed_sequence_size`` or ``seq_length``).
        vocab_size: The target's vocabulary size.
        key: The config key naming the file, for messages.

    Returns:
        DataReport of the file, or None when ``path`` is not a local ``.json``/``.jsonl`` file.

    Raises:
        ValueError: naming the file and line (or sample index) and the rule broken; also for a
            missing file or one without any conversation.
    """
    path = Path(path)
    if path.suffix not in (".json", ".jsonl"):
        return None
    if not path.is_file():
        raise ValueError(f"{key}: {path} does not exist")
    samples = truncated = longest = 0
    for where, sample in _samples(path):
        messages = sample.get("messages") if isinstance(sample, dict) else None
        if not isinstance(messages, list):
            raise ValueError(f"{where}: a sample needs a 'messages' list (OpenAI chat format)")
        if not messages:
            raise ValueError(f"{where}: empty conversation ('messages' is [])")
        if not all(isinstance(message, dict) for message in messages):
            raise ValueError(f"{where}: every message must be an object with 'role' and 'content'")
        if not any(message.get("role") == "assistant" for message in messages):
            raise ValueError(f"{where}: no assistant turn, so nothing to supervise")
        try:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        except Exception as error:  # jinja2's TemplateError, or a KeyError/TypeError from a malformed message
            raise ValueError(f"{where}: the chat template rejects this conversation ({error})") from None
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(f"{where}: token id {outside[0]} is outside the target's vocabulary [0, {vocab_size})")
        samples += 1
        truncated += len(ids) > max_length
        longest = max(longest, len(ids))
    if samples == 0:
        raise ValueError(f"{key}: {path} holds no conversation")
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


__all__ = ["DataReport", "check_chat_data", "check_recipe_data", "require_a_batch_per_rank"]

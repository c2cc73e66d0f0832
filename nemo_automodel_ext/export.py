"""A servable draft from any checkpoint: the released ``mtp.*`` layout in one consolidated folder.

Run: ``python -m nemo_automodel_ext.export RUN_OR_CHECKPOINT [--all]``

A checkpoint's ``model/`` holds the draft in the released V4.1 key layout (``mtp.{layer}.*``,
``embed.weight``, ``head.weight``; upstream's DSpark state-dict adapter writes it), as one
safetensors file per rank. nemo_automodel 0.7.0 consolidates them into ``model/consolidated/``
when ``checkpoint.save_consolidated`` is on, but fails on an FSDP2-sharded draft on more than one
rank (``KeyError: 'mtp.0.ffn.experts.N.w1.weight'`` in ``_write_overall_metadata_file_from_shards``:
its key index lacks the split expert projections). The plugin consolidates instead, complete or
not at all:

- ``read_sharded_draft(model_dir, expected, shard_files)``: each tensor assembled from every rank's
  slice at the offsets the files record (``DCP_SHARDING_INFO``), each element written exactly once.
  With ``expected`` (``run/draft_checkpoint.expected_draft_shapes``: the draft's keys and global shapes
  from its config) a missing rank file, a missing key, a gap, an overlap or a slice outside its tensor
  is refused by name; ``shard_files`` (the rank count the run recorded) names a missing file outright;
- ``export_draft(checkpoint)``: ``model/consolidated/`` as upstream writes it for one rank
  (``model-00001-of-00001.safetensors``, ``model.safetensors.index.json``, the draft's config and
  tokenizer files). An existing folder is kept only when it validates (header, every expected tensor
  at its shape and readable, the index); otherwise it is rebuilt. The new folder is written beside it
  and swapped in atomically (``renameat2(RENAME_EXCHANGE)``; two renames where the filesystem lacks
  it), so a kill leaves the old folder or the complete new one, never a partial one.

The recipe exports its last checkpoint at the end of every run (``recipes/loop_hooks.py``, after
checking that rank 0 sees every rank's file); the evaluator reads sharded checkpoints through
``read_draft``. Serving: ``docs/recipes.md`` ("Serving the draft").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nemo_automodel_ext.run.draft_checkpoint import Shapes, check_draft_structure, expected_draft_shapes
from nemo_automodel_ext.run.run_record import recorded_draft_shard_files, resolve_checkpoint

logger = logging.getLogger(__name__)

CONSOLIDATED = "consolidated"
WEIGHTS = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"
#: Files of a checkpoint's ``model/.hf_metadata`` that describe the shards, not the model.
_SHARD_METADATA = ("fqn_to_file_index_mapping.json", "fqn_to_dtype_mapping.json")
_SHARD_NAME = re.compile(r"^shard-(\d+)-")
_RENAME_EXCHANGE = 2  # linux/fs.h


def _sharding(handle) -> dict[str, list[int]]:
    info = json.loads((handle.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
    return {key: list(value["saved_offsets"]) for key, value in info.items()}


def draft_files(model_dir: Path) -> list[Path]:
    """The per-rank files of a checkpoint's ``model/`` (``shard-*.safetensors``, else ``*.safetensors``)."""
    return sorted(model_dir.glob("shard-*.safetensors")) or sorted(model_dir.glob("*.safetensors"))


def _require_every_rank_file(model_dir: Path, files: list[Path], shard_files: int | None) -> None:
    """Refuse when a rank's file is absent: the recorded count, else gaps in the ``shard-NNNNN`` numbering."""
    numbers = sorted(int(match.group(1)) for file in files if (match := _SHARD_NAME.match(file.name)))
    if not numbers:
        return
    count = shard_files or numbers[-1]
    missing = sorted(set(range(1, count + 1)) - set(numbers))
    if missing:
        names = ", ".join(f"shard-{number:05d}-*" for number in missing[:4])
        raise ValueError(
            f"{model_dir}: {len(missing)} of {count} rank files missing ({names}); the run wrote one per rank. "
            "Copy every rank's model/ files into one folder (node-local checkpoint folders?) and export again"
        )


def read_sharded_draft(
    model_dir: Path, expected: Shapes | None = None, shard_files: int | None = None
) -> dict[str, torch.Tensor]:
    """Whole tensors from the per-rank files ``model_dir/shard-*.safetensors`` (or ``*.safetensors``).

    Args:
        model_dir: A checkpoint's ``model/`` folder (or a consolidated folder).
        expected: Released key -> global shape the draft must have (``expected_draft_shapes``); None takes
            each tensor's size from the slices present (the evaluator, which checks the result itself).
        shard_files: How many per-rank files the run wrote (``recorded_draft_shard_files``), if known.

    Returns:
        New tensors by released key, each assembled from its slices.

    Raises:
        ValueError: naming the file or key when there are no files, a file cannot be read, a rank's file is
            missing, or (with ``expected``) a key is missing or unknown, or a tensor's slices overlap, leave a
            gap or fall outside its global shape.
    """
    files = draft_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir}: no draft weights (model/*.safetensors)")
    _require_every_rank_file(model_dir, files, shard_files)
    pieces: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                offsets = _sharding(handle)
                for key in handle.keys():
                    tensor = handle.get_tensor(key)
                    pieces.setdefault(key, []).append((offsets.get(key, [0] * tensor.dim()), tensor))
        except Exception as error:  # safetensors' SafetensorError (truncated or corrupt header), OSError
            raise ValueError(f"{file}: cannot read the draft weights ({' '.join(str(error).split())})") from None
    if expected is not None:
        # Keys first (draft layers, experts a layer, missing tensors), before any tensor is assembled.
        check_draft_structure({key: expected.get(key, ()) for key in pieces}, expected, str(model_dir))
    state = {}
    for key, slices in pieces.items():
        first = slices[0][1]
        if expected is not None:
            shape = list(expected[key])
        else:
            shape = [max(offset[d] + part.shape[d] for offset, part in slices) for d in range(first.dim())]
        whole = first.new_empty(shape)
        covered = torch.zeros(shape, dtype=torch.int32)
        for offset, part in slices:
            if len(offset) != len(shape) or any(o + s > n for o, s, n in zip(offset, part.shape, shape)):
                raise ValueError(
                    f"{model_dir}: a slice of {key} at offsets {offset} of shape {list(part.shape)} falls outside its "
                    f"global shape {shape}"
                )
            region = tuple(slice(start, start + size) for start, size in zip(offset, part.shape))
            whole[region] = part
            covered[region] += 1
        if not bool((covered == 1).all()):
            held = int((covered > 0).sum())
            raise ValueError(
                f"{model_dir}: {key}'s slices overlap or leave a gap across the shard files ({held} of "
                f"{covered.numel()} elements present): a rank's file is missing or short"
            )
        state[key] = whole
    return state


def read_draft(model_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's draft weights: ``model/consolidated/`` when present, else the assembled shards."""
    consolidated = sorted((model_dir / CONSOLIDATED).glob("*.safetensors"))
    return read_sharded_draft(model_dir / CONSOLIDATED if consolidated else model_dir)


def consolidated_problem(folder: Path, expected: Shapes) -> str | None:
    """Why ``folder`` is not a complete consolidated draft (None when it is): its weights file's header, every
    expected tensor at its shape and readable, and the index naming exactly those keys."""
    weights = folder / WEIGHTS
    if not weights.is_file():
        return f"no {WEIGHTS}"
    try:
        with safe_open(str(weights), "pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            check_draft_structure(shapes, expected, str(weights))
            for key in shapes:
                handle.get_tensor(key)
        index = json.loads((folder / INDEX).read_text())
        if set(index["weight_map"]) != set(shapes):
            return f"{INDEX} does not list the weights file's tensors"
    except Exception as error:  # header, truncation, a missing tensor, a broken index
        return " ".join(str(error).split())
    return None


def _exchange(staging: Path, target: Path) -> None:
    """Put ``staging`` at ``target`` atomically; the old ``target`` (if any) ends up at ``staging``."""
    if not target.exists():
        staging.rename(target)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    at_fdcwd = -100
    if renameat2 is not None and renameat2(at_fdcwd, bytes(staging), at_fdcwd, bytes(target), _RENAME_EXCHANGE) == 0:
        return
    # No atomic exchange here (filesystem or libc): a reader between the two renames finds no folder and reads
    # the per-rank files instead, which hold the same tensors.
    aside = staging.with_name(f".{CONSOLIDATED}.old")
    shutil.rmtree(aside, ignore_errors=True)
    target.rename(aside)
    staging.rename(target)
    aside.rename(staging)


def export_draft(checkpoint: Path, expected: Shapes | None = None) -> Path:
    """Write ``checkpoint/model/consolidated/`` from the per-rank files, or keep it when it validates.

    Args:
        checkpoint: A checkpoint folder (``config.yaml`` and ``model/``).
        expected: The draft's released keys and global shapes; default ``expected_draft_shapes(checkpoint)``.

    Returns:
        The consolidated folder.

    Raises:
        ValueError: when the per-rank files do not make the whole draft (``read_sharded_draft``); nothing is
            written then.
    """
    checkpoint = Path(checkpoint)
    model_dir = checkpoint / "model"
    target = model_dir / CONSOLIDATED
    expected = expected_draft_shapes(checkpoint) if expected is None else expected
    staging = model_dir / f".{CONSOLIDATED}.partial"
    for leftover in (staging, staging.with_name(f".{CONSOLIDATED}.old")):  # an interrupted export's
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        problem = consolidated_problem(target, expected)
        if problem is None:
            return target
        logger.warning("%s is not a complete draft (%s): rebuilding it", target, problem)
    state = read_sharded_draft(model_dir, expected, recorded_draft_shard_files(checkpoint))
    state = {key: value.contiguous() for key, value in state.items()}
    staging.mkdir()
    save_file(state, str(staging / WEIGHTS), metadata={"format": "pt"})
    total = sum(value.numel() * value.element_size() for value in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(state, WEIGHTS)}
    (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    metadata = model_dir / ".hf_metadata"
    for file in sorted(metadata.glob("*")) if metadata.is_dir() else []:
        if file.is_file() and file.name not in _SHARD_METADATA:
            shutil.copy2(file, staging / file.name)
    for file in staging.iterdir():  # on disk before the swap makes them visible
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    _exchange(staging, target)
    shutil.rmtree(staging, ignore_errors=True)  # the replaced folder, if any
    return target


def require_rank_files_on_rank0(model_dir: Path | None, group=None) -> None:
    """Collective: refuse on every rank when rank 0 cannot see a draft file another rank sees.

    Each rank lists the per-rank files of its own view of the checkpoint (``model_dir``, None when it has
    none); rank 0, which exports, must see every one of them. With node-local checkpoint folders it does
    not, and an export from what it sees would be partial.

    Args:
        model_dir: This rank's view of the checkpoint's ``model/`` folder.
        group: Process group (default: the default group).

    Raises:
        ValueError: on every rank, naming the files rank 0 lacks and the ranks that see them.
    """
    import torch.distributed as dist

    names = sorted(file.name for file in draft_files(model_dir)) if model_dir is not None else []
    views: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, names, group=group)
    ours = set(views[0] or ())
    lacking = {name: rank for rank, view in enumerate(views) for name in view or () if name not in ours}
    if lacking:
        listed = ", ".join(f"{name} (rank {rank})" for name, rank in sorted(lacking.items())[:4])
        raise ValueError(
            f"rank 0 cannot see {len(lacking)} of the draft's per-rank files of {model_dir}: {listed}. "
            "The checkpoint folders look node-local: put checkpoint.checkpoint_dir on a filesystem every node "
            "shares, or copy every rank's model/ files into one folder and run python -m nemo_automodel_ext.export"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_automodel_ext.export", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run's output folder, its checkpoint folder, or one checkpoint")
    parser.add_argument("--all", action="store_true", help="every complete checkpoint of the run, not only LATEST")
    options = parser.parse_args(argv)
    from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete

    try:
        latest = resolve_checkpoint(options.run)
        checkpoints = [latest]
        if options.all:
            checkpoints = [
                path
                for path in sorted(latest.parent.glob("epoch_*_step_*"))
                if (path / "config.yaml").is_file() and not is_checkpoint_incomplete(path)
            ]
        for checkpoint in checkpoints:
            print(f"{checkpoint.name}: {export_draft(checkpoint)}")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


__all__ = [
    "consolidated_problem",
    "draft_files",
    "export_draft",
    "read_draft",
    "read_sharded_draft",
    "require_rank_files_on_rank0",
]


if __name__ == "__main__":
    sys.exit(main())

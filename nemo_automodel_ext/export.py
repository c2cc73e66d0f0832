"""A servable draft from any checkpoint: the released ``mtp.*`` layout in one consolidated folder.

Run: ``python -m nemo_automodel_ext.export RUN_OR_CHECKPOINT [--all]``

A checkpoint's ``model/`` holds the draft in the released V4.1 key layout (``mtp.{layer}.*``,
``embed.weight``, ``head.weight``; upstream's DSpark state-dict adapter writes it), as one
safetensors file per rank. nemo_automodel 0.7.0 consolidates them into ``model/consolidated/``
when ``checkpoint.save_consolidated`` is on, but fails on an FSDP2-sharded draft on more than one
rank (``KeyError: 'mtp.0.ffn.experts.N.w1.weight'`` in ``_write_overall_metadata_file_from_shards``:
its key index lacks the split expert projections). The plugin consolidates instead:

- ``read_sharded_draft(model_dir)``: each tensor assembled from every rank's slice at the offsets
  the files record (``DCP_SHARDING_INFO``), each element written exactly once, or a ValueError;
- ``export_draft(checkpoint)``: ``model/consolidated/`` as upstream writes it for one rank
  (``model-00001-of-00001.safetensors``, ``model.safetensors.index.json``, the target's config and
  tokenizer files), written to a temporary folder and renamed, so an interrupted export leaves none.

The recipe exports its last checkpoint at the end of every run; the evaluator reads sharded
checkpoints through ``read_draft``. Serving: ``docs/recipes.md`` ("Serving the draft").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONSOLIDATED = "consolidated"
WEIGHTS = "model-00001-of-00001.safetensors"
#: Files of a checkpoint's ``model/.hf_metadata`` that describe the shards, not the model.
_SHARD_METADATA = ("fqn_to_file_index_mapping.json", "fqn_to_dtype_mapping.json")


def _sharding(file: Path) -> dict[str, list[int]]:
    with safe_open(str(file), "pt") as handle:
        metadata = handle.metadata() or {}
    info = json.loads(metadata.get("DCP_SHARDING_INFO", "{}"))
    return {key: list(value["saved_offsets"]) for key, value in info.items()}


def read_sharded_draft(model_dir: Path) -> dict[str, torch.Tensor]:
    """Whole tensors from the per-rank files ``model_dir/shard-*.safetensors`` (or ``*.safetensors``).

    Args:
        model_dir: A checkpoint's ``model/`` folder.

    Returns:
        New tensors by released key, each assembled from its slices.

    Raises:
        ValueError: naming the file or key when there are no files, a file cannot be read, or a
            tensor's slices overlap or leave a gap.
    """
    files = sorted(model_dir.glob("shard-*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no draft weights (model/*.safetensors)")
    pieces: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for file in files:
        try:
            offsets = _sharding(file)
            with safe_open(str(file), "pt") as handle:
                for key in handle.keys():
                    tensor = handle.get_tensor(key)
                    pieces.setdefault(key, []).append((offsets.get(key, [0] * tensor.dim()), tensor))
        except Exception as error:  # safetensors' SafetensorError (truncated or corrupt header), OSError
            raise ValueError(f"{file}: cannot read the draft weights ({' '.join(str(error).split())})") from None
    state = {}
    for key, slices in pieces.items():
        first = slices[0][1]
        shape = [max(offset[d] + part.shape[d] for offset, part in slices) for d in range(first.dim())]
        whole = first.new_empty(shape)
        covered = torch.zeros(shape, dtype=torch.int32)
        for offset, part in slices:
            region = tuple(slice(start, start + size) for start, size in zip(offset, part.shape))
            whole[region] = part
            covered[region] += 1
        if not bool((covered == 1).all()):
            raise ValueError(f"{model_dir}: {key}'s slices overlap or leave a gap across the shard files")
        state[key] = whole
    return state


def read_draft(model_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's draft weights: ``model/consolidated/`` when present, else the assembled shards."""
    consolidated = sorted((model_dir / CONSOLIDATED).glob("*.safetensors"))
    return read_sharded_draft(model_dir / CONSOLIDATED if consolidated else model_dir)


def export_draft(checkpoint: Path) -> Path:
    """Write ``checkpoint/model/consolidated/`` from the per-rank files (kept when already there).

    Args:
        checkpoint: A checkpoint folder (``config.yaml`` and ``model/``).

    Returns:
        The consolidated folder.
    """
    model_dir = Path(checkpoint) / "model"
    target = model_dir / CONSOLIDATED
    if (target / WEIGHTS).is_file():
        return target
    state = {key: value.contiguous() for key, value in read_sharded_draft(model_dir).items()}
    staging = model_dir / f".{CONSOLIDATED}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    save_file(state, str(staging / WEIGHTS), metadata={"format": "pt"})
    total = sum(value.numel() * value.element_size() for value in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(state, WEIGHTS)}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    metadata = model_dir / ".hf_metadata"
    for file in sorted(metadata.glob("*")) if metadata.is_dir() else []:
        if file.is_file() and file.name not in _SHARD_METADATA:
            shutil.copy2(file, staging / file.name)
    shutil.rmtree(target, ignore_errors=True)  # a partial upstream consolidation
    staging.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_automodel_ext.export", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run's output folder, its checkpoint folder, or one checkpoint")
    parser.add_argument("--all", action="store_true", help="every complete checkpoint of the run, not only LATEST")
    options = parser.parse_args(argv)
    from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete

    from nemo_automodel_ext.evaluation.cli import resolve_checkpoint

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


if __name__ == "__main__":
    sys.exit(main())

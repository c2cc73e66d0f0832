"""Two gloo ranks: rank 0 must see every rank's draft file before it exports (``require_rank_files_on_rank0``).

Usage: gloo_export.py SHARED_ROOT NODE_LOCAL_ROOT. SHARED_ROOT holds a two-rank checkpoint both ranks see;
under NODE_LOCAL_ROOT each rank gets its own copy holding only its own file, as node-local disks would.
"""

import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from gloo_exit import finish

from nemo_automodel_ext.export import export_draft, require_rank_files_on_rank0

dist.init_process_group("gloo")
rank = dist.get_rank()
shared = Path(sys.argv[1]) / "checkpoints" / "epoch_0_step_5"
require_rank_files_on_rank0(shared / "model")
if rank == 0:
    export_draft(shared)
dist.barrier()
local = Path(sys.argv[2]) / f"node{rank}" / "checkpoints" / "epoch_0_step_5"
if rank == 0:
    for node in (0, 1):
        copy = Path(sys.argv[2]) / f"node{node}" / "checkpoints" / "epoch_0_step_5"
        shutil.copytree(shared, copy, ignore=shutil.ignore_patterns("consolidated"))
        (copy / "model" / f"shard-{2 - node:05d}-model-00001-of-00001.safetensors").unlink()  # the other rank's
dist.barrier()
try:
    require_rank_files_on_rank0(local / "model")
except ValueError as error:
    message = str(error)
    assert "rank 0 cannot see 1 of the draft's per-rank files" in message, message
    assert "shard-00002-model-00001-of-00001.safetensors (rank 1)" in message and "node-local" in message, message
else:
    raise AssertionError(f"rank {rank}: node-local folders were not refused")
assert not (local / "model" / "consolidated").exists()
finish()

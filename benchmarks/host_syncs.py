"""Count host syncs by dispatch on CPU: what would stall the host on a GPU, attributed to call sites.

A sync is an op whose result size or value the host must read: ``.item()`` / ``int()`` /
``bool()`` (``aten._local_scalar_dense``), ``nonzero``, ``masked_select``, ``unique``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``, and ``Tensor.tolist()``. Each is recorded
with the nearest call site in this repository or nemo_automodel. Sites that run only on CPU
(a branch that takes a device-free path on CUDA) are listed apart.
"""

from __future__ import annotations

import collections
import traceback
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
    "aten.unique_dim.default",
}
# Call sites whose sync happens on CPU tensors only (their CUDA branch reads nothing back).
CPU_ONLY_SITES = ("packing.py:gather_columns",)


def _site() -> str:
    frames = [frame for frame in traceback.extract_stack()[:-3] if "host_syncs.py" not in frame.filename]
    for frame in reversed(frames):
        if "/torch/optim/" in frame.filename:
            return f"torch.optim:{frame.name}"
    for frame in reversed(frames):
        if "nemo_automodel" in frame.filename or "benchmarks" in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
    if frames:  # torch itself (autograd, compile wrappers): its innermost Python frame
        return f"torch/{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].name}"
    return "autograd engine"


class _Mode(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    @classmethod
    def is_infra_mode(cls) -> bool:
        # Lets torch.compile'd kernels (upstream's expert activations) run under the counter.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        sync = name in _SYNC_OPS
        if name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            sync = True
        if name.startswith("aten.index.Tensor"):
            sync = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        if sync:
            self.counts[_site()] += 1
        return func(*args, **kwargs)


@contextmanager
def count_host_syncs():
    """Count syncs inside the block; yields a Counter {call site: count}."""
    counts: collections.Counter = collections.Counter()
    original = torch.Tensor.tolist

    def tolist(self):
        counts[_site()] += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with _Mode(counts):
            yield counts
    finally:
        torch.Tensor.tolist = original


_OWNERS = {
    "plugin": ("dspark_target.py", "cp.py", "cp_draft.py", "anchors.py", "cp_trainer.py", "dspark_draft.py"),
    "upstream target forward": ("attention.py", "experts.py", "model.py", "layers.py", "sharder.py"),
    "upstream loss": ("loss.py",),
}


def owner(site: str) -> str:
    """Who a call site belongs to: the plugin, upstream's target forward or loss, torch, or a CPU-only branch."""
    if site in CPU_ONLY_SITES:
        return "CPU-only (none on GPU)"
    if site.startswith("torch.optim"):
        return "torch AdamW on CPU (capturable/fused on GPU)"
    for name, files in _OWNERS.items():
        if site.split(":")[0] in files:
            return name
    return "other (torch)"


def by_owner(counts: collections.Counter) -> dict[str, int]:
    totals: dict[str, int] = {}
    for site, count in counts.items():
        totals[owner(site)] = totals.get(owner(site), 0) + count
    return totals

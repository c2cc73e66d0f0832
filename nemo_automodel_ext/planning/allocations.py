"""Live tensor bytes of a computation, counted at the dispatcher: the measuring tape of the memory calibration.

``LiveBytes`` is a ``TorchDispatchMode`` that sees every aten op below autograd. Before each op the live
set is swept of storages whose last reference died; the op's new output storages are then added (with
their byte sizes), so ``current`` is the bytes of every storage created inside the mode and still alive
(saved for backward, carried to the next layer, or held by the caller), and ``peak`` its maximum right
after an op ran. Tensors created before the mode (parameters, inputs) are not counted; in-place ops and
views (outputs sharing an input's storage) add nothing. Not seen: a kernel's private workspace (cuBLAS,
the TileLang kernels) and the CUDA caching allocator's rounding and fragmentation, which the memory model
keeps in its runtime reserve and capacity fraction.

The count depends only on shapes and dtypes, never on timing or the machine, so tests can pin it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Count live bytes of storages created while the mode is active.

    Attributes:
        current: Bytes of counted storages alive now.
        peak: Largest ``current`` seen after any op (reset with ``reset_peak``).
        windows: A timeline: the largest ``current`` of each window ``mark`` opened, by name (the bytes alive
            when it opened included).
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.windows: dict[str, int] = {}
        self._window: str | None = None

    def mark(self, window: str | None) -> None:
        """Close the open window (its peak kept in ``windows``) and open ``window`` at the bytes alive now
        (None: open none). A name marked twice keeps the larger of its peaks."""
        self._sweep()
        if self._window is not None:
            self.windows[self._window] = max(self.windows.get(self._window, 0), self._window_peak)
        self._window, self._window_peak = window, self.current

    def reset_peak(self) -> int:
        """Start a new peak at the bytes alive now; returns them."""
        self._sweep()
        self.peak = self.current
        return self.current

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.current -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()  # storages freed since the last op (Python temporaries) no longer count
        out = func(*args, **(kwargs or {}))
        inputs = {
            value.untyped_storage()._cdata
            for value in tree_leaves((args, kwargs))
            if isinstance(value, torch.Tensor) and value.device.type != "meta"
        }
        for value in tree_leaves(out):
            if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                continue
            storage = value.untyped_storage()
            key = storage._cdata
            if key in inputs:  # a view or an in-place result: no new bytes
                continue
            known = self._live.get(key)
            if known is not None and not known[0].expired():
                continue
            if known is not None:  # a freed storage's address reused by a new one
                self.current -= known[1]
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        if self._window is not None:
            self._window_peak = max(self._window_peak, self.current)
        self._sweep()
        return out


def peak_bytes(function: Callable[[], Any]) -> tuple[int, int, Any]:
    """Run ``function()`` under ``LiveBytes``.

    Returns:
        (peak bytes alive during the call, bytes still alive after it, its result). Bytes are those of
        storages the call created; the result keeps its own storages alive (they count as still alive).
    """
    with LiveBytes() as tape:
        result = function()
    tape._sweep()
    return tape.peak, tape.current, result


__all__ = ["LiveBytes", "peak_bytes"]

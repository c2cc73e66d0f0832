"""Keep the demo's output about the user's run: drop warnings that do not concern it.

On a CPU-only machine, importing the framework logs torchao's failed loads of its CUDA kernel
libraries, torch's notice that two torchao enums need no pytree registration, and Megatron-FSDP's
fallback from Transformer Engine; none changes what a CPU run computes. With a local target
(the demo), upstream also warns that feature layer ids including the last layer cannot be
captured by the standard SGLang runtime: true, and irrelevant to a target that is never served
there. ``install_quiet_filters`` drops exactly those records (matched by logger and message);
every other warning still prints. The plugin's launcher and evaluation CLI install it first.
"""

from __future__ import annotations

import logging
import warnings

SGLANG_LOGGER = "nemo_automodel.components.speculative.dspark.common"


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def install_quiet_filters(cpu_only: bool) -> None:
    """Drop the CPU-irrelevant import-time warnings (``cpu_only``) and nothing else; idempotent."""
    if not cpu_only:
        return
    _add(logging.getLogger("torchao"), "Failed to load ")
    _add(logging.getLogger("torch.utils._pytree"), "is an Enum subclass and is now natively supported")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def quiet_sglang_warning() -> None:
    """Drop upstream's SGLang-capture warning: for local targets, which are never served on SGLang."""
    _add(logging.getLogger(SGLANG_LOGGER), "the standard SGLang runtime cannot capture")


def _add(logger: logging.Logger, fragment: str) -> None:
    if not any(isinstance(f, _DropMessages) and fragment in f.fragments for f in logger.filters):
        logger.addFilter(_DropMessages(fragment))


__all__ = ["install_quiet_filters", "quiet_sglang_warning"]

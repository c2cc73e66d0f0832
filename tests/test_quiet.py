"""The demo's output drops only the warnings that do not concern a CPU run (issue 17 item 13)."""

from __future__ import annotations

import logging

from nemo_automodel_ext.quiet import SGLANG_LOGGER, install_quiet_filters, quiet_sglang_warning


def _passes(logger_name: str, message: str) -> bool:
    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger_name, logging.WARNING, __file__, 1, message, (), None)
    return bool(logger.filter(record))


def test_cpu_irrelevant_warnings_are_dropped_and_others_kept(monkeypatch):
    # Start from no filters: other tests of this process may have installed them already (the evaluator's
    # load_run quiets the SGLang warning); monkeypatch restores the loggers' own lists afterwards.
    for name in ("torchao", "torch.utils._pytree", SGLANG_LOGGER):
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    torchao_load = "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library"
    assert _passes("torchao", torchao_load)
    install_quiet_filters(cpu_only=True)
    install_quiet_filters(cpu_only=True)  # idempotent
    assert not _passes("torchao", torchao_load)
    assert _passes("torchao", "quantization config is deprecated")  # any other torchao warning still prints
    assert not _passes("torch.utils._pytree", "<enum 'X'> is an Enum subclass and is now natively supported by")
    sglang = "target_layer_ids [1, 3, 5] include [5], which the standard SGLang runtime cannot capture"
    assert _passes(SGLANG_LOGGER, sglang)
    quiet_sglang_warning()
    assert not _passes(SGLANG_LOGGER, sglang) and _passes(SGLANG_LOGGER, "another warning")
    assert len(logging.getLogger("torchao").filters) == 1

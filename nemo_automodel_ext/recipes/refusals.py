"""One readable line for every refusal of the packed V4.1 DSpark recipe.

A refusal (a ValueError naming a key, file or rule; a FloatingPointError for a non-finite loss)
raised in any rank is otherwise buried under each rank's traceback and torchrun's failure report.
``report_refusal`` logs it once, on the first rank that reaches it, as ``error: <message>``, and
writes it to ``$NEMO_AUTOMODEL_EXT_REFUSAL_FILE`` when set. The plugin's launcher
(``python -m nemo_automodel_ext.launch``, used by ``make distill``) sets that variable and prints
the message as the very last line after torchrun exits.
"""

from __future__ import annotations

import contextlib
import logging
import os

logger = logging.getLogger("nemo_automodel_ext.refusal")
REFUSAL_FILE_ENV = "NEMO_AUTOMODEL_EXT_REFUSAL_FILE"
REFUSALS = (ValueError, FloatingPointError)


def one_line(error: BaseException) -> str:
    """``error``'s message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


@contextlib.contextmanager
def report_refusal():
    """Re-raise any refusal unchanged after logging it on one line (and recording it for the launcher)."""
    try:
        yield
    except REFUSALS as error:
        message = one_line(error)
        logger.error("error: %s", message)
        path = os.environ.get(REFUSAL_FILE_ENV)
        if path:
            with contextlib.suppress(OSError), open(path, "x") as handle:  # the first rank to refuse writes
                handle.write(message + "\n")
        raise


__all__ = ["REFUSAL_FILE_ENV", "one_line", "report_refusal"]

"""Export one checkpoint, SIGKILLed before its 1st, 2nd, ... file operation in turn (fault injection).

Usage: kill_export.py CHECKPOINT. Operations: each tensor file written, text file written, file copied,
fsync, the swap into place and each folder removal. For each AT, a forked child runs the export and
kills itself before its AT-th operation, as a preemption would (no handler, no flush); the parent then
records what a reader finds: the old weights file byte for byte ("old") or a complete folder ("new"),
and fails on anything else. It stops at the first AT the export outlives and prints the outcomes as JSON.
"""

import json
import os
import signal
import sys
from pathlib import Path

from nemo_automodel_ext import export
from nemo_automodel_ext.run.draft_checkpoint import expected_draft_shapes

checkpoint = Path(sys.argv[1])
folder = checkpoint / "model" / export.CONSOLIDATED
old = (folder / export.WEIGHTS).read_bytes()
expected = expected_draft_shapes(checkpoint)
_seen = [0]


def _before(owner, name, at):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        _seen[0] += 1
        if _seen[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


outcomes = []
for at in range(1, 100):
    child = os.fork()
    if child == 0:
        for owner, name in ((export, "save_file"), (export.shutil, "copy2"), (export.os, "fsync")):
            _before(owner, name, at)
        for owner, name in ((export, "_exchange"), (export.shutil, "rmtree"), (Path, "write_text")):
            _before(owner, name, at)
        export.export_draft(checkpoint, expected)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        outcomes.append("finished")
        break
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    if (folder / export.WEIGHTS).is_file() and (folder / export.WEIGHTS).read_bytes() == old:
        outcomes.append("old")
    else:
        problem = export.consolidated_problem(folder, expected)
        assert problem is None, f"killed before operation {at}: {folder} is partial ({problem})"
        outcomes.append("new")
print(json.dumps(outcomes))

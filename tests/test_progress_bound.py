"""Subprocess runs are bounded by silence, not by wall time (issue 17 item 12)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from progress_bound import run_until_stalled


def test_a_finished_command_returns_its_output_and_code():
    result = run_until_stalled([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    assert (result.returncode, result.stdout, result.stderr) == (0, "out\n", "err\n")


def test_a_silent_command_is_stopped_at_the_stall_bound():
    with pytest.raises(subprocess.TimeoutExpired):
        run_until_stalled([sys.executable, "-c", "import time; time.sleep(600)"], stall=1.0)

"""Shared fixtures: the tiny V4.1 target and a two-process gloo launcher."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# Shared check helpers (dspark_checks.py) import by name in tests and in gloo worker scripts.
sys.path.insert(0, str(TESTS))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_gloo(script: Path, *args: str, world_size: int = 2, timeout: float = 900) -> None:
    """Run ``script`` as ``world_size`` gloo ranks on 127.0.0.1 and fail with their output if any rank fails."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(TESTS), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs, failed = [], False
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
            failed = True
        outputs.append(f"--- rank {rank} (exit {proc.returncode}) ---\n{out[-6000:]}")
        failed = failed or proc.returncode != 0
    if failed:
        pytest.fail("gloo ranks failed:\n" + "\n".join(outputs))


@pytest.fixture(scope="session")
def tiny_target():
    """The shipped tiny V4.1 target (fp32, eval, seed 0); tests must not modify it."""
    from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target

    return build_tiny_target(seed=0)


# The longest xdist groups, queued first in this order (``make test`` passes ``--no-loadscope-reorder``, so xdist
# hands its workers the groups in collection order). The Flash-width group, about half the suite's seconds and one
# test at a time, starts at once on one worker while the other runs the rest. In xdist's default order (most tests
# first) it started after the kill sweep and ran alone at the end: 2,689 s in all on 2 cores, one worker idle for
# the last 12 minutes.
FIRST_GROUPS = ("flash_widths", "tiny_recipe_run", "fault_injection")


def _group_rank(item) -> int:
    marker = item.get_closest_marker("xdist_group")
    name = (marker.args[0] if marker.args else marker.kwargs.get("name")) if marker else None
    return FIRST_GROUPS.index(name) if name in FIRST_GROUPS else len(FIRST_GROUPS)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """A test using ``flash_widths_alone`` joins xdist group ``flash_widths``: one worker runs them one at a time.
    ``FIRST_GROUPS`` then go first, each in collection order (the Flash-width calibration re-measurement, the
    longest test, first of all); every other test keeps its place after them."""
    for item in items:
        if "flash_widths_alone" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("flash_widths"))
    items[:] = sorted(items, key=_group_rank)  # stable


@pytest.fixture
def flash_widths_alone(tmp_path_factory):
    """An exclusive lock held for the test: Flash-width models take up to 13 GB, so under pytest-xdist no two tests
    using this run at once, whatever the scheduler does (``make test`` also keeps them on one worker: the hook
    above). The lock file lies in the folder the workers' temporary folders share; one process
    takes no lock."""
    import fcntl

    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "flash_widths.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@pytest.fixture
def gloo():
    """``gloo(script, *args)``: run a worker script as two gloo ranks (see run_gloo)."""
    return run_gloo

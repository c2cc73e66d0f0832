"""Subprocesses bounded by progress, not by wall time: a slow machine must not fail a correct program.

``run_until_stalled`` runs a command like ``subprocess.run(capture_output=True, text=True)`` but
kills it only when it prints nothing (stdout or stderr) for ``stall`` seconds. The recipe prints a
line per logged step, so a run that is merely slow keeps going; a hung one still fails.
"""

from __future__ import annotations

import subprocess
import threading
import time

STALL_SECONDS = 900.0


def run_until_stalled(command, *, stall: float = STALL_SECONDS, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command``; raise ``subprocess.TimeoutExpired`` only after ``stall`` seconds without output."""
    kwargs.pop("timeout", None)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    chunks: dict[str, list[str]] = {"out": [], "err": []}
    last = [time.monotonic()]

    def pump(stream, sink):
        for line in iter(stream.readline, ""):
            sink.append(line)
            last[0] = time.monotonic()
        stream.close()

    threads = [
        threading.Thread(target=pump, args=(process.stdout, chunks["out"]), daemon=True),
        threading.Thread(target=pump, args=(process.stderr, chunks["err"]), daemon=True),
    ]
    for thread in threads:
        thread.start()
    while process.poll() is None:
        if time.monotonic() - last[0] > stall:
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired(command, stall, "".join(chunks["out"]), "".join(chunks["err"]))
        time.sleep(0.5)
    for thread in threads:
        thread.join()
    return subprocess.CompletedProcess(command, process.returncode, "".join(chunks["out"]), "".join(chunks["err"]))


__all__ = ["STALL_SECONDS", "run_until_stalled"]

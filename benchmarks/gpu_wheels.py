"""Build ``.whl/``: the wheels ``make gpu-check`` needs on the lent H200 beyond its image, and check them.

The lent image has Python 3.12, torch 2.11, transformers 5.17 and no nemo_automodel, and nothing there can
be downloaded; the working tree (with ``.whl/``) travels, at most 64 MiB. ``WHEELS`` is what is missing there
for the plugin's imports and the kit's four sections (found by importing them in a venv holding only the
image's packages, ``docs/testing.md``); each is fetched for CPython 3.12 on manylinux x86-64 without its
dependencies, and the plugin's own wheel is built from this tree (its entry points register the draft).

    python benchmarks/gpu_wheels.py            # download and build into .whl/, then check the sizes
    python benchmarks/gpu_wheels.py --check    # no network: the list here against docs/testing.md

On the device: ``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl`` and
``PYTHONPATH=/tmp/site`` (``make gpu-check`` does both).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / ".whl"
DOCS = REPO / "docs" / "testing.md"
LIMIT_BYTES = 64 * 2**20  # the device tool's limit on the travelling tree, wheels included

#: (requirement, why it travels). Versions are those the plugin's CPU venv resolves (pyproject's pins).
WHEELS = (
    ("nemo-automodel==0.7.0", "the framework the plugin extends"),
    ("transformers==5.18.0", "nemo_automodel 0.7.0 imports transformers.utils.hub.resolve_revision (5.18)"),
    ("datasets==5.2.0", "nemo_automodel's dataset modules, imported by its recipes"),
    ("dill==0.4.1", "datasets"),
    ("multiprocess==0.70.19", "datasets"),
    ("torchdata==0.11.0", "nemo_automodel's stateful dataloader"),
    ("torchao==0.18.0", "nemo_automodel's optimizer and quantisation imports"),
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def documented() -> list[str]:
    """The requirements docs/testing.md lists between its ``gpu-wheels`` markers (one ``- `req` `` a line)."""
    text = DOCS.read_text()
    match = re.search(r"<!-- gpu-wheels -->(.*?)<!-- /gpu-wheels -->", text, re.S)
    if match is None:
        raise ValueError(f"{DOCS}: no <!-- gpu-wheels --> ... <!-- /gpu-wheels --> block")
    return re.findall(r"^- `([^`]+)`", match.group(1), re.M)


def check_documented() -> None:
    """Raise ``ValueError`` when docs/testing.md's list differs from ``WHEELS``."""
    listed, expected = documented(), [requirement for requirement, _ in WHEELS]
    if listed != expected:
        raise ValueError(f"{DOCS}: the gpu-wheels block lists {listed}; benchmarks/gpu_wheels.py has {expected}")


def tree_bytes() -> int:
    """Bytes of the files that travel besides ``.whl/`` (tracked, and untracked files git does not ignore)."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in names if name and (REPO / name.decode()).is_file())


def build() -> int:
    """Download ``WHEELS`` and build the plugin's wheel into ``.whl/``; the travelling bytes."""
    FOLDER.mkdir(exist_ok=True)
    for stale in FOLDER.glob("*.whl"):
        stale.unlink()
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    for requirement, _ in WHEELS:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
            + ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(FOLDER), requirement],
            check=True,
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(FOLDER), "."],
        cwd=REPO,
        check=True,
    )
    wheels = sorted(FOLDER.glob("*.whl"))
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:6.1f} MiB  {wheel.name}")
    return sum(wheel.stat().st_size for wheel in wheels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare the list with docs/testing.md")
    args = parser.parse_args(argv)
    check_documented()
    if args.check:
        print(f"docs/testing.md lists the {len(WHEELS)} wheels of benchmarks/gpu_wheels.py")
        return 0
    wheels = build()
    total = wheels + tree_bytes()
    print(f"wheels {wheels / 2**20:.1f} MiB + tree {(total - wheels) / 2**20:.1f} MiB = {total / 2**20:.1f} MiB")
    if total > LIMIT_BYTES:
        print(f"error: {total / 2**20:.1f} MiB is over the device tool's 64 MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

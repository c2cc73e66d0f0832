"""Kill the tiny recipe with SIGKILL at 13 precise moments; each resume from LATEST must lose nothing.

After every kill, ``checkpoint.restore_from: LATEST`` must resume from the last complete checkpoint
(never a partial one), and the run's ``metrics.jsonl`` must end up with exactly one record per
step whose token count, data checksum and loss equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete
from progress_bound import run_until_stalled

from nemo_automodel_ext.launch import torchrun_command

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml"
# Under `make test` (pytest-xdist): every kill on one worker, so the reference run is made once.
pytestmark = pytest.mark.xdist_group("fault_injection")
# (kill point, occurrence): checkpoints every 2 steps; occurrence 2 is the step-4 checkpoint's write.
KILLS = [
    ("mid_step_forward", 5),
    ("after_optimizer_step", 4),
    ("model_shard_write", 3),
    ("consolidated_export", 2),
    ("optimizer_write", 2),
    ("after_optimizer_write", 2),
    ("rng_write", 2),
    ("progress_meta_torn", 2),
    ("config_write", 2),
    ("before_publish", 2),
    ("after_latest_moves", 2),
    ("metrics_line_torn", 5),
    ("mid_eval", 2),
]


def _run(workdir: Path, run: str, *extra: str, kill: tuple[str, int] | None = None):
    assets = workdir / "assets"
    command = torchrun_command(
        YAML,
        [
            f"--recipe_args.tiny_assets_dir={assets}",
            f"--recipe_args.target_model_name_or_path={assets / 'target'}",
            f"--recipe_args.train_data_path={workdir / 'train.jsonl'}",
            f"--recipe_args.val_data_path={workdir / 'val.jsonl'}",
            "--recipe_args.num_epochs=1",
            "--recipe_args.micro_batch_size=2",
            "--recipe_args.ckpt_every_steps=2",
            "--recipe_args.log_every_steps=1",
            "--recipe_args.eval_every_steps=3",
            f"--recipe_args.output_dir={workdir / run}",
            f"--checkpoint.checkpoint_dir={workdir / run / 'checkpoints'}",
            *extra,
        ],
        entry=[str(Path(__file__).with_name("inject_kill.py"))] if kill else None,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kill:
        env.update(KILL_POINT=kill[0], KILL_AT=str(kill[1]))
    return run_until_stalled(command, cwd=workdir, env=env)


def _train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "split" not in record]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (assets generated once, shared with the killed runs)."""
    from nemo_automodel_ext.demo.tiny_assets import ensure_tiny_assets

    workdir = tmp_path_factory.mktemp("faults")
    assets = ensure_tiny_assets(workdir / "assets", train_samples=200)
    (workdir / "train.jsonl").write_text("".join((assets / "train.jsonl").read_text().splitlines(True)[:64]))
    (workdir / "val.jsonl").write_text("".join((assets / "val.jsonl").read_text().splitlines(True)[:8]))
    result = _run(workdir, "reference")
    assert result.returncode == 0, result.stderr[-4000:]
    records = _train_records(workdir / "reference")
    assert [record["step"] for record in records] == list(range(1, len(records) + 1)) and len(records) >= 6
    return workdir, records


@pytest.mark.parametrize("point,occurrence", KILLS, ids=[point for point, _ in KILLS])
def test_a_kill_anywhere_resumes_with_nothing_lost(reference, point, occurrence):
    workdir, expected = reference
    run = f"killed_{point}"
    killed = _run(workdir, run, kill=(point, occurrence))
    assert "(SIGKILL)" in killed.stderr, f"{point}: the kill did not happen\n{killed.stderr[-3000:]}"
    complete = [
        path
        for path in (workdir / run / "checkpoints").glob("epoch_*_step_*")
        if not is_checkpoint_incomplete(path) and (path / "progress_meta.pt").exists()
    ]
    resumed = _run(workdir, run, "--checkpoint.restore_from=LATEST")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    log = resumed.stdout + resumed.stderr
    if complete:  # the last complete checkpoint, never a partial one
        latest = max(complete, key=lambda path: int(path.name.rsplit("_", 1)[1]))
        assert f"Resuming from checkpoint: {latest}" in log, (point, [path.name for path in complete])
    else:
        assert "Resuming from checkpoint" not in log, point
    records = _train_records(workdir / run)
    assert [record["step"] for record in records] == [record["step"] for record in expected], point
    for got, want in zip(records, expected, strict=True):
        assert (got["tokens"], got["data_checksum"]) == (want["tokens"], want["data_checksum"]), (point, got["step"])
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), (point, got["step"])
    evals = [json.loads(line) for line in (workdir / run / "metrics.jsonl").read_text().splitlines()]
    assert all(line.get("split") in (None, "val") for line in evals)

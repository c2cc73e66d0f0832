"""Does packing pay, honestly? The four batchings of the tiny recipe, each tuned on a dev split, over seeds.

Run: ``make compare`` (every mix, three seeds) or ``make compare COMPARE_ARGS=--quick`` (the demo mix, two seeds,
fewer epochs: one on the demo mix, ``Mix.quick_epochs``, and three test evaluations a run); ``--publish`` also
writes the tables into README.md and docs/packing.md and keeps the results in ``docs/compare/packing_value.json``
(the file the README's numbers are rendered from, tested). A run of some mixes
(``COMPARE_ARGS="--mix skewed --publish"``) replaces only theirs: each mix keeps the commit and protocol (full or
quick) it was measured at. ``--resume`` after a stopped run keeps the runs it finished (``train``).

The protocol, per data mix (``MIXES``), for ``packed``, ``grouped``, ``dynamic`` and ``upstream``
(``recipe_args.batching``, ``nemo_automodel_ext/run/batching.py``):

- **the same token budget a micro-batch**: ``row x rows`` tokens (a packed micro-batch's); ``dynamic`` and
  ``grouped`` fill micro-batches to it and pad to the batch's longest; ``upstream`` pads every conversation to the
  mix's longest and takes the rows that fit the budget;
- **the same wall-clock budget**: ``packed`` trains the mix's epochs; its median training seconds over its
  learning-rate grid are the budget, and every other batching trains the optimizer steps that fit it (its seconds
  a step measured first, on a quarter of the data), stopping inside an epoch where the budget ends
  (``recipe_args.max_steps``), its schedule planned for those steps;
- **learning rates chosen on dev**: each batching trains at every rate of its mix's grid (``Mix.grid``, the first
  seed) and keeps
  the one whose final draft has the highest greedy tau on the mix's ``dev.jsonl`` (held-out prompts in neither
  training nor the test set); a grid whose best is at an edge is extended by a factor 2 beyond it (twice at most);
- **seeds**: the chosen rate is trained again with the other seeds (``shuffle_seed``: the draft's init and the
  data order); every figure is the mean ± sd over seeds (sd with n - 1);
- **reported on test only**: greedy tau on the mix's ``val.jsonl`` (the test prompts), measured in the run every
  sixth of it (a third with ``--quick``), on the same packed batches for every batching (``train_s``: training
  seconds, evaluations left out);
- **goals at mean - sd**, against the strongest baseline (the highest mean final test tau): packed's tau minus the
  baseline's at equal training time is >= 0 on every mix, and packed reaches the baseline's final test tau in at
  most half the baseline's time on the long-tailed mix (the pessimistic end: mean + sd of the ratio <= 0.5).

Every run is pinned to one CPU core with one thread (``--jobs`` runs at once, default: the cores), so runs in
parallel do not share a core and every batching is timed alike. Times are this machine's. Upstream's own V4.1
DSpark recipe does not run here (``train_dspark`` builds a V4.1 target only through
``DeepseekV41DSparkTargetConfig.build``, which refuses anything but CUDA); ``upstream`` is its data path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import packing_report  # noqa: E402

YAML = REPO / "recipes" / "deepseek_v41" / "dspark_tiny_cpu.yaml"
OUT = REPO / "outputs" / "compare"
ASSETS = REPO / "outputs" / "tiny_assets"
BATCHINGS = packing_report.BATCHINGS
LR_GRID = (2.5e-3, 5e-3, 1e-2, 2e-2)
SEEDS = (42, 43, 44)
QUICK_SEEDS = (42, 43)
EVALS = 6  # in-run test evaluations a run (besides every epoch's end)
QUICK_EVALS = 3  # --quick: its one-epoch runs evaluate at 0, a third, two thirds and the end


@dataclass(frozen=True)
class Mix:
    """A data mix: packed row width, rows a micro-batch (the token budget is their product), packed epochs;
    ``answered``: test and dev conversations end at their last non-empty answer (``multiturn.answered_prompts``);
    ``grid``: the learning rates every batching trains first (then extended at an edge)."""

    row: int
    rows: int
    epochs: int
    quick_epochs: int
    answered: bool = False
    grid: tuple[float, ...] = LR_GRID


# demo: the demo's single-turn data (12-44 tokens); skewed: multi-turn, 18-312 tokens (demo/multiturn.py SKEWED);
# longtail: multi-turn, median about 200 tokens, a tail to the 2,048-token row (LONG_TAILED).
MIXES = {
    "demo": Mix(row=128, rows=8, epochs=5, quick_epochs=1),
    "skewed": Mix(row=512, rows=2, epochs=8, quick_epochs=3),
    # the demo target leaves 65% of the long-tailed test conversations' last answers empty (EOS alone): cut at
    # their last answer, all 60 are scored on something to draft (skewed keeps the uncut files its published
    # results were measured on)
    # its grid starts where LR_GRID ended: on the first seed's dev grids (LR_GRID, extended) every batching's best
    # rate was 2e-2 or above (packed 8e-2, dynamic 4e-2, grouped and upstream 2e-2; docs/packing.md)
    "longtail": Mix(row=2048, rows=1, epochs=4, quick_epochs=2, answered=True, grid=(1e-2, 2e-2, 4e-2, 8e-2)),
}


# The long-tailed mix runs only when named (--mix longtail): writing its data regenerates every turn of 8,714
# planned exchanges without a KV cache, which took 34 minutes on 2 cores (60 at 6287a0d; demo/multiturn.py), once per
# machine (outputs/compare/longtail_data is kept).
DEFAULT = ("demo", "skewed")


def mix_data(mix: str) -> dict[str, Path]:
    """``train``, ``test`` (``val.jsonl``) and ``dev`` of a mix, generated on first use (``Mix.answered``: test
    and dev cut at each conversation's last non-empty answer, ``*_answered.jsonl``)."""
    from nemo_automodel_ext.demo.multiturn import LONG_TAILED, SKEWED, answered_prompts, ensure_multiturn_mix
    from nemo_automodel_ext.demo.tiny_assets import ensure_tiny_assets

    ensure_tiny_assets(ASSETS)
    if mix == "demo":
        folder = ASSETS
    elif mix == "skewed":
        folder = ensure_multiturn_mix(OUT / "skewed_data", mix=SKEWED)
    else:
        folder = ensure_multiturn_mix(OUT / "longtail_data", seed=2, mix=LONG_TAILED)
    data = {"train": folder / "train.jsonl", "test": folder / "val.jsonl", "dev": folder / "dev.jsonl"}
    if MIXES[mix].answered:
        for split in ("test", "dev"):
            data[split] = answered_prompts(data[split], data[split].with_name(f"{data[split].stem}_answered.jsonl"))
    return data


def lengths(path: Path) -> list[int]:
    """Tokens of each conversation in ``path`` (the chat template applied)."""
    from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer
    from nemo_automodel_ext.evaluation.sequences import encode_conversation

    tokenizer = build_tokenizer()
    return [
        len(encode_conversation(tokenizer, json.loads(line)["messages"])[0]) for line in path.read_text().splitlines()
    ]


@dataclass(frozen=True)
class Shape:
    """How one batching lays out a mix's micro-batches under the same token budget."""

    seq_length: int
    packed_sequence_size: int
    micro_batch_size: int
    steps_an_epoch: int  # dynamic, grouped, upstream: the sampler's count; packed: an estimate


def shape(batching: str, mix: Mix, counted: list[int], longest: int) -> Shape:
    """The recipe keys of ``batching`` at ``mix``'s token budget (``row x rows``)."""
    from nemo_automodel_ext.run.batching import TokenBudgetBatchSampler

    budget = mix.row * mix.rows
    if batching == "packed":
        return Shape(mix.row, mix.row, mix.rows, math.ceil(sum(counted) / (0.9 * budget)))
    if batching == "upstream":
        rows = max(1, budget // longest)
        return Shape(longest, 0, rows, math.ceil(len(counted) / rows))
    sampler = TokenBudgetBatchSampler(counted, budget, grouped=batching == "grouped", shuffle=True, seed=0, epochs=1)
    return Shape(mix.row, 0, mix.rows, len(sampler))


def within_budget(budget_s: float, step_s: float, steps_an_epoch: int) -> tuple[int, int]:
    """A baseline's optimizer steps in ``budget_s`` training seconds at ``step_s`` a step (at least one), and the
    epochs they start (``recipe_args.num_epochs``; the last one stops at the steps, ``recipe_args.max_steps``)."""
    if step_s <= 0:
        raise ValueError(f"the probe measured {step_s} s a step; it must be positive")
    steps = max(1, round(budget_s / step_s))
    return steps, math.ceil(steps / steps_an_epoch)


class Cores:
    """One run a core: each job holds a CPU of this process's affinity while it runs."""

    def __init__(self, jobs: int) -> None:
        self.free: queue.Queue[int] = queue.Queue()
        for core in sorted(os.sched_getaffinity(0))[:jobs]:
            self.free.put(core)

    @contextmanager
    def one(self):
        core = self.free.get()
        try:
            yield core
        finally:
            self.free.put(core)


def pinned(command: list[str], core: int, log: Path) -> None:
    """Run ``command`` on ``core`` alone with one thread; its output goes to ``log``; refuses on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as handle:
        pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
        code = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, preexec_fn=pin).returncode
    if code != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed (exit {code}); its log: {log}\n{log.read_text()[-3000:]}")


@dataclass(frozen=True)
class Job:
    mix: str
    batching: str
    lr: float
    seed: int
    epochs: int
    shape: Shape
    data: dict
    probe: bool = False
    tag: str = ""  # a prefix of the run's folder name
    max_steps: int | None = None  # the run stops after these optimizer steps (recipe_args.max_steps)
    evals: int = EVALS  # in-run test evaluations (besides every epoch's end)

    @property
    def steps(self) -> int:
        """Optimizer steps the run trains (``steps_an_epoch`` an estimate for packed)."""
        planned = self.epochs * self.shape.steps_an_epoch
        return planned if self.max_steps is None else min(planned, self.max_steps)

    @property
    def output(self) -> Path:
        name = "probe" if self.probe else f"lr{self.lr:g}_seed{self.seed}"
        return OUT / self.mix / self.batching / f"{self.tag}{name}"


def overrides(job: Job, train_path: Path) -> list[str]:
    """The tiny recipe's command-line overrides of ``job``: its batching's shape, epochs, seed and rate; the test
    prompts (``val.jsonl``) as the in-run evaluation, never dev (dev scores only the final draft, ``dev_command``)."""
    every = max(1, job.steps // job.evals)
    output = job.output
    return [
        f"--recipe_args.tiny_assets_dir={ASSETS}",
        f"--recipe_args.target_model_name_or_path={ASSETS / 'target'}",
        f"--recipe_args.train_data_path={train_path}",
        f"--recipe_args.output_dir={output}",
        f"--checkpoint.checkpoint_dir={output / 'checkpoints'}",
        f"--recipe_args.batching={job.batching}",
        f"--recipe_args.seq_length={job.shape.seq_length}",
        f"--recipe_args.packed_sequence_size={job.shape.packed_sequence_size}",
        f"--recipe_args.micro_batch_size={job.shape.micro_batch_size}",
        f"--recipe_args.num_epochs={job.epochs}",
        *([] if job.max_steps is None else [f"--recipe_args.max_steps={job.max_steps}"]),
        f"--recipe_args.shuffle_seed={job.seed}",
        f"--optimizer.lr={job.lr}",
        *(
            # every step logged: its seconds a step are timed past the first (start-up left out); with the
            # recipe's 10, the skewed grouped probe (10 steps) logged one step, start-up included, and measured
            # 0.6 s a step for 0.2, so grouped trained 4 epochs (45 s) of a 145 s budget
            ["--recipe_args.val_data_path=None", "--checkpoint.enabled=false", "--recipe_args.log_every_steps=1"]
            if job.probe
            else [f"--recipe_args.val_data_path={job.data['test']}", f"--recipe_args.eval_every_steps={every}"]
        ),
    ]


def dev_command(job: Job) -> list[str]:
    """The exact greedy evaluation of ``job``'s final draft on the mix's dev prompts (``dev_eval.json``; the
    untrained draft left out: nothing reads its dev score)."""
    command = [sys.executable, "-m", "nemo_automodel_ext.evaluation", str(job.output), "--device", "cpu", "--no-init"]
    return command + ["--data", str(job.data["dev"]), "--output", str(job.output / "dev_eval.json")]


def finished(job: Job, record: dict) -> dict | None:
    """The summary a finished run of ``job`` left (``summary.json``, written last), if it was run as ``record``
    says (the same commands, code and data); None otherwise: a killed run, or another one in that folder."""
    saved = job.output / "summary.json"
    if not saved.exists():
        return None
    stored = json.loads(saved.read_text())
    return stored["summary"] if stored["record"] == record else None


def train(job: Job, cores: Cores, resume: bool = False) -> dict:
    """Train ``job`` pinned to a core, then score its final draft on dev (same core); returns its summary.

    With ``resume``, a run that finished before with the same commands, code (the commit and any uncommitted
    change to it) and data files is not run again: its ``summary.json`` is returned (``make compare
    COMPARE_ARGS=--resume`` after a stopped run)."""
    output = job.output
    train_path = output / "probe.jsonl" if job.probe else job.data["train"]
    launch = [sys.executable, "-m", "nemo_automodel_ext.launch", str(YAML), *overrides(job, train_path)]
    dev = None if job.probe else dev_command(job)
    record = {"code": code_state(), "launch": launch[1:], "dev": None if dev is None else dev[1:]}
    record["data"] = {split: hashlib.sha256(path.read_bytes()).hexdigest() for split, path in job.data.items()}
    if resume and (summary := finished(job, record)) is not None:
        print(f"[{job.mix}/{job.batching}] {'probe' if job.probe else f'lr {job.lr:g} seed {job.seed}'}: reused")
        return dict(summary, reused=True)
    if output.exists():
        shutil.rmtree(output)  # a new run, not a resumed one
    output.mkdir(parents=True)
    if job.probe:  # a quarter of the data, one epoch, no evaluation: seconds a step
        lines = job.data["train"].read_text().splitlines(keepends=True)
        train_path.write_text("".join(lines[: len(lines) // 4]))
    with cores.one() as core:
        started = time.perf_counter()
        pinned(launch, core, output / "train.log")
        if dev is not None:
            pinned(dev, core, output / "dev_eval.log")
        wall = time.perf_counter() - started
    summary = summarise(output)
    summary.update(lr=job.lr, seed=job.seed, epochs=job.epochs, wall_s=wall)
    if dev is not None:
        scores = json.loads((output / "dev_eval.json").read_text())["greedy"]
        summary["dev_tau"] = [result["tau"] for result in scores.values()][-1]  # the final checkpoint's
    print(
        f"[{job.mix}/{job.batching}] {'probe' if job.probe else f'lr {job.lr:g} seed {job.seed}'}: "
        f"{job.epochs} epochs, {summary['step']} steps, {summary['train_s']:.0f} s training"
        + ("" if job.probe else f", dev tau {summary['dev_tau']:.3f}, test tau {summary['points'][-1][2]:.3f}"),
        flush=True,
    )
    partial = output / "summary.json.partial"  # renamed into place: a killed write leaves no summary.json
    partial.write_text(json.dumps({"record": record, "summary": summary}) + "\n")
    partial.replace(output / "summary.json")
    return summary


def summarise(output: Path) -> dict:
    """A run's test curve (train_s, captured tokens, greedy tau) and its counters at the end of training
    (``metrics.jsonl``: the last evaluation, at the last epoch's end, or the last logged step of a probe)."""
    from nemo_automodel_ext.recipes.plots import read_records

    records = read_records(output / "metrics.jsonl")
    evals = [r for r in records if r.get("split") == "val" and "greedy_tau" in r]
    points = [(r["train_s"], r["captured_tokens"], r["greedy_tau"]) for r in evals]
    if points:
        points[0] = (0.0, 0, points[0][2])  # the draft at initialisation: before training
    logged = [r for r in records if r.get("split") != "val"]
    last = evals[-1] if evals else logged[-1]
    keys = ("train_s", "captured_tokens", "tokens", "documents", "supervised_slots", "step")
    first, end = logged[0], logged[-1]  # seconds a step past the first logged one (start-up left out)
    if end["step"] > first["step"]:
        step_s = (end["train_s"] - first["train_s"]) / (end["step"] - first["step"])
    else:  # one logged step (a short probe): its seconds, start-up included
        step_s = end["train_s"] / max(1, end["step"])
    return {"points": points, "step_s": step_s, **{key: last[key] for key in keys}}


class Protocol:
    """One mix's protocol: a driver thread a batching, runs scheduled on ``cores`` by ``pool``."""

    def __init__(self, mix: str, quick: bool, cores: Cores, pool: ThreadPoolExecutor, resume: bool = False) -> None:
        self.mix, self.spec, self.cores, self.pool, self.resume = mix, MIXES[mix], cores, pool, resume
        self.epochs = self.spec.quick_epochs if quick else self.spec.epochs
        self.seeds = QUICK_SEEDS if quick else SEEDS
        self.evals = QUICK_EVALS if quick else EVALS
        self.data = mix_data(mix)
        counted = lengths(self.data["train"])
        longest = 8 * math.ceil(max(counted + lengths(self.data["test"]) + lengths(self.data["dev"])) / 8)
        self.shapes = {batching: shape(batching, self.spec, counted, longest) for batching in BATCHINGS}
        self.budget_s: float | None = None
        self.budget_ready = threading.Event()
        self.max_steps: dict[str, int] = {}  # each baseline's optimizer steps within the budget
        self.reused = 0  # runs a stopped run had finished (--resume)
        self.counting = threading.Lock()

    def run(self, job: Job) -> dict:
        return self.runs([job])[0]

    def runs(self, jobs: list[Job]) -> list[dict]:
        futures = [self.pool.submit(train, job, self.cores, self.resume) for job in jobs]
        summaries = [future.result() for future in futures]
        with self.counting:
            self.reused += sum(bool(summary.get("reused")) for summary in summaries)
        return summaries

    def job(self, batching: str, lr: float, seed: int, epochs: int, probe: bool = False) -> Job:
        steps = self.max_steps.get(batching)
        shape = self.shapes[batching]
        return Job(self.mix, batching, lr, seed, epochs, shape, self.data, probe, max_steps=steps, evals=self.evals)

    def batching(self, batching: str) -> dict:
        """Steps within the budget, the learning-rate grid on dev (extended at an edge), then the other seeds."""
        seed = self.seeds[0]
        steps_an_epoch = self.shapes[batching].steps_an_epoch
        if batching == "packed":
            epochs, epoch_s, steps = self.epochs, None, None
        else:
            probe = self.run(self.job(batching, self.spec.grid[1], seed, 1, probe=True))
            epoch_s = probe["step_s"] * steps_an_epoch
            self.budget_ready.wait()
            steps, epochs = within_budget(self.budget_s, probe["step_s"], steps_an_epoch)
            self.max_steps[batching] = steps
        grid = self.runs([self.job(batching, lr, seed, epochs) for lr in self.spec.grid])
        try:
            for _ in range(2):  # extend an edge optimum by a factor 2 beyond it
                grid.sort(key=lambda run: run["lr"])
                best = max(range(len(grid)), key=lambda i: grid[i]["dev_tau"])
                if 0 < best < len(grid) - 1:
                    break
                lr = grid[0]["lr"] / 2 if best == 0 else grid[-1]["lr"] * 2
                grid.append(self.run(self.job(batching, lr, seed, epochs)))
        finally:
            if batching == "packed":
                self.budget_s = statistics.median(run["train_s"] for run in grid)
                self.budget_ready.set()
        grid.sort(key=lambda run: run["lr"])
        chosen = max(grid, key=lambda run: run["dev_tau"])
        seeds = [chosen, *self.runs([self.job(batching, chosen["lr"], each, epochs) for each in self.seeds[1:]])]
        trained = epochs if steps is None else round(steps / steps_an_epoch, 2)  # epochs, a fraction when capped
        return {
            "epochs": trained,
            "epoch_s": epoch_s,
            "max_steps": steps,
            "lr": chosen["lr"],
            "grid": grid,
            "seeds": seeds,
        }

    def measure(self) -> dict:
        with ThreadPoolExecutor(len(BATCHINGS)) as drivers:
            futures = {batching: drivers.submit(self.batching, batching) for batching in BATCHINGS}
            batchings = {batching: future.result() for batching, future in futures.items()}
        shapes = {batching: vars(each) for batching, each in self.shapes.items()}
        return {
            "budget_s": self.budget_s,
            "token_budget": self.spec.row * self.spec.rows,
            "lr_grid": list(self.spec.grid),
            "shapes": shapes,
            "batchings": batchings,
            "seeds": list(self.seeds),
            "reused": self.reused,
        }


def commit() -> str:
    """HEAD's short hash, with ``+changes`` when tracked files differ from it (the code measured is not HEAD's)."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head + ("+changes" if changed.stdout.strip() else "")


def code_state() -> str:
    """``commit()``, with a digest of the uncommitted changes to tracked files when there are some: two states
    with different edits on the same commit differ."""
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--binary"], capture_output=True).stdout
    return commit() + (f":{hashlib.sha256(diff).hexdigest()[:16]}" if diff else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", nargs="+", choices=sorted(MIXES), help=f"mixes to run (default: {', '.join(DEFAULT)})")
    parser.add_argument("--quick", action="store_true", help="the same protocol on fewer seeds and epochs")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs a stopped run finished (same commands, code and data: summary.json) and run the rest",
    )
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="runs at once, one core each")
    parser.add_argument(
        "--publish",
        action="store_true",
        help="write the tables into README.md and docs/packing.md (the mixes not run keep their published results)",
    )
    options = parser.parse_args()
    mixes = options.mix or (["demo"] if options.quick else list(DEFAULT))
    started = time.perf_counter()
    cores = Cores(max(1, options.jobs))
    results = {
        "mode": "quick" if options.quick else "full",
        "lr_grid": list(LR_GRID),
        "jobs": max(1, options.jobs),
        "machine": f"{os.cpu_count()} cores",
        "commit": commit(),
        "mixes": {},
    }
    with ThreadPoolExecutor(64) as pool:
        for mix in mixes:
            mix_started = time.perf_counter()
            measured = Protocol(mix, options.quick, cores, pool, options.resume).measure()
            results["mixes"][mix] = {
                "commit": results["commit"],
                "wall_s": time.perf_counter() - mix_started,
                **measured,
            }
    results["wall_s"] = time.perf_counter() - started
    saved, picture = report(results, options.publish)
    print(f"\npicture: {picture}\nresults: {saved} ({results['wall_s'] / 60:.1f} min)")


def report(results: dict, publish: bool) -> tuple[Path, Path]:
    """Keep ``results`` in ``outputs/compare/`` and print their tables; with ``publish``, also write them into the
    docs and draw the docs' picture (every published mix: the merged results when some mixes were not run).
    Without it, the picture goes beside the results: the docs' picture always shows the docs' tables.

    Returns:
        The results file and the picture.
    """
    packing_report.finish(results)
    OUT.mkdir(parents=True, exist_ok=True)
    saved = OUT / "packing_value.json"
    saved.write_text(json.dumps(results, indent=1) + "\n")
    print(packing_report.render(results))
    if publish:
        return saved, packing_report.draw(packing_report.publish(results))
    return saved, packing_report.draw(results, OUT / packing_report.PICTURE.name)


if __name__ == "__main__":
    main()

"""Statistics, tables, goals and the picture of ``benchmarks/packing_value.py`` (``make compare``).

Everything here reads the results dictionary ``packing_value.py`` measures (``outputs/compare/packing_value.json``;
``--publish`` keeps a copy in ``docs/compare/packing_value.json``); nothing trains. ``readme_block`` and
``render`` are the text README.md and docs/packing.md carry between their ``packing-value`` markers, so
``tests/test_packing_value.py`` can check that the published numbers are the stored ones.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "docs" / "compare" / "packing_value.json"
PICTURE = REPO / "docs" / "images" / "packed_vs_unpacked.png"
BATCHINGS = ("packed", "grouped", "dynamic", "upstream")
BASELINES = BATCHINGS[1:]
LONG_TAILED = "longtail"  # the mix the time goal is stated on
MARKERS = ("<!-- packing-value -->", "<!-- /packing-value -->")


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for one value)."""
    values = [float(value) for value in values]
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def at(points: list, x: float) -> float:
    """Greedy tau at ``x`` training seconds, linear between evaluation points; the last tau after the end."""
    for (a, _, tau_a), (b, _, tau_b) in zip(points, points[1:]):
        if a <= x <= b:
            return tau_a if b == a else tau_a + (tau_b - tau_a) * (x - a) / (b - a)
    return points[0][2] if x < points[0][0] else points[-1][2]


def first_reaching(points: list, tau: float) -> float | None:
    """Training seconds at which the curve first reaches ``tau`` (linear between points); None if never."""
    if points and points[0][2] >= tau:
        return points[0][0]
    for (s0, _, t0), (s1, _, t1) in zip(points, points[1:]):
        if t1 >= tau:
            return s0 if t0 >= tau else s0 + (s1 - s0) * (tau - t0) / (t1 - t0)
    return None


def final_tau(run: dict) -> float:
    return run["points"][-1][2]


def end_s(run: dict) -> float:
    return run["points"][-1][0]


def against(packed: list[dict], baseline: list[dict]) -> dict:
    """Packed against one baseline, seed by seed (the i-th seed of each): the greedy tau gap at equal training time
    (the shorter run's end) and packed's time to the baseline's final tau over the baseline's time.

    Returns:
        ``gap`` and ``ratio`` as (mean, sd); ``ratio`` is None when some seed of packed never reaches it.
    """
    gaps, ratios = [], []
    for ours, theirs in zip(packed, baseline):
        t = min(end_s(ours), end_s(theirs))
        gaps.append(at(ours["points"], t) - at(theirs["points"], t))
        reach = first_reaching(ours["points"], final_tau(theirs))
        ratios.append(None if reach is None else reach / end_s(theirs))
    return {"gap": mean_sd(gaps), "ratio": None if None in ratios else mean_sd(ratios), "seeds": len(gaps)}


def finish(results: dict) -> dict:
    """Add each mix's per-batching statistics, comparisons and goals, and the goals over mixes (in place)."""
    for mix in results["mixes"].values():
        for entry in mix["batchings"].values():
            runs = entry["seeds"]
            entry["final_tau"] = mean_sd([final_tau(run) for run in runs])
            for key in ("train_s", "captured_tokens", "tokens", "documents", "supervised_slots", "step"):
                entry[key] = statistics.fmean(run[key] for run in runs)
        batchings = mix["batchings"]
        strongest = max(BASELINES, key=lambda name: batchings[name]["final_tau"][0])
        mix["strongest"] = strongest
        mix["against"] = {name: against(batchings["packed"]["seeds"], batchings[name]["seeds"]) for name in BASELINES}
    results["goals"] = goals(results)
    return results


def goals(results: dict) -> dict:
    """The issue's goals at mean - sd: not behind the strongest baseline at equal time on any mix, and half its
    time to its final tau on the long-tailed mix (mean + sd of the ratio, the pessimistic end)."""
    behind = {}
    for name, mix in results["mixes"].items():
        gap, sd = mix["against"][mix["strongest"]]["gap"]
        behind[name] = {"gap_mean_minus_sd": gap - sd, "met": gap - sd >= 0}
    longtail = results["mixes"].get(LONG_TAILED)
    if longtail is None:
        half = {"met": None, "why": f"the {LONG_TAILED} mix was not run"}
    else:
        ratio = longtail["against"][longtail["strongest"]]["ratio"]
        half = {"ratio_mean_plus_sd": None if ratio is None else ratio[0] + ratio[1]}
        half["met"] = ratio is not None and ratio[0] + ratio[1] <= 0.5
    return {"not_behind": behind, "half_time_on_long_tail": half}


def pm(pair: tuple[float, float] | None, digits: int = 2) -> str:
    return "never" if pair is None else f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


def mode_of(mix: dict, results: dict) -> str:
    """A mix's protocol, ``full`` or ``quick``: its own where results of both were merged, else the run's."""
    return mix.get("mode", results["mode"])


def compare_command(results: dict) -> str:
    """The command that measured ``results``: both when its mixes were measured under both protocols."""
    modes = {mode_of(mix, results) for mix in results["mixes"].values()}
    commands = {"full": "`make compare`", "quick": "`make compare COMPARE_ARGS=--quick`"}
    return " and ".join(commands[mode] for mode in ("full", "quick") if mode in modes)


def mix_title(name: str, mix: dict, mode: str) -> str:
    seeds = len(mix["seeds"])
    measured = f"; at {mix['commit']}, {mix['wall_s'] / 60:.0f} min" if "commit" in mix else ""
    if mix.get("reused"):  # --resume: the minutes are the last invocation's, not the reused runs'
        measured += f" resuming {mix['reused']} finished runs"
    return (
        f"**{name}** mix ({mode}: {seeds} seeds; {mix['token_budget']:,} tokens a micro-batch; "
        f"budget {mix['budget_s']:.0f} s, packed's training seconds{measured})"
    )


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table: the first column left-aligned, the others right."""
    return [
        "| " + " | ".join(header) + " |",
        "| --- |" + " ---: |" * (len(header) - 1),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def batching_table(mix: dict) -> list[str]:
    header = "batching, lr (dev), epochs, train s, ms a step, captured tokens, real, supervised slots, documents/s"
    rows = []
    for name in BATCHINGS:
        entry = mix["batchings"][name]
        bold = "**" if name in ("packed", mix["strongest"]) else ""
        rows.append(
            [
                f"{bold}{name}{bold}",
                f"{entry['lr']:g}",
                f"{entry['epochs']}",
                f"{entry['train_s']:.0f}",
                f"{1000 * entry['train_s'] / entry['step']:.0f}",
                f"{entry['captured_tokens']:,.0f}",
                f"{100 * entry['tokens'] / entry['captured_tokens']:.0f}%",
                f"{entry['supervised_slots']:,.0f}",
                f"{entry['documents'] / entry['train_s']:.0f}",
                pm(entry["final_tau"]),
            ]
        )
    return table([*header.split(", "), "final test tau"], rows)


def grid_table(mix: dict) -> list[str]:
    rates = sorted({run["lr"] for entry in mix["batchings"].values() for run in entry["grid"]})
    rows = []
    for name in BATCHINGS:
        entry = mix["batchings"][name]
        scores = {run["lr"]: run["dev_tau"] for run in entry["grid"]}
        cells = [
            "" if rate not in scores else (f"**{scores[rate]:.2f}**" if rate == entry["lr"] else f"{scores[rate]:.2f}")
            for rate in rates
        ]
        rows.append([name, *cells])
    return table(["dev greedy tau", *(f"lr {rate:g}" for rate in rates)], rows)


def against_table(mix: dict) -> list[str]:
    rows = []
    for name in BASELINES:
        row = mix["against"][name]
        label = f"{name} (strongest)" if name == mix["strongest"] else name
        rows.append([label, pm(row["gap"], 2), pm(row["ratio"], 2)])
    header = [
        "packed against",
        "equal-time greedy tau gap",
        "packed's time to the baseline's final tau, over the baseline's time",
    ]
    return table(header, rows)


def goal_lines(results: dict) -> list[str]:
    lines = []
    for name, goal in results["goals"]["not_behind"].items():
        verdict = "met" if goal["met"] else "MISSED"
        lines.append(
            f"- {name}: packed not behind the strongest baseline at equal time, mean - sd of the gap "
            f"{goal['gap_mean_minus_sd']:+.2f} >= 0: **{verdict}**"
        )
    half = results["goals"]["half_time_on_long_tail"]
    if half["met"] is None:
        lines.append(
            f"- long-tailed mix, packed at the strongest baseline's final tau in half its time: not measured "
            f"({half['why']})"
        )
    else:
        value = half["ratio_mean_plus_sd"]
        lines.append(
            f"- long-tailed mix, packed at the strongest baseline's final tau in half its time, mean + sd of the "
            f"ratio {'never' if value is None else f'{value:.2f}'} <= 0.5: **{'met' if half['met'] else 'MISSED'}**"
        )
    return lines


def render(results: dict) -> str:
    """The full markdown report: per mix its batchings, learning-rate grids and comparisons; then the goals."""
    parts = [
        f"Measured by {compare_command(results)} (each mix's protocol in its title) at "
        f"{results['commit']} ({results['machine']}, {results['jobs']} runs at once, one core and thread each; "
        f"{results['wall_s'] / 60:.0f} min). Mean ± sd over training seeds; taus on the test prompts; learning rates "
        "chosen on dev."
    ]
    for name, mix in results["mixes"].items():
        parts += ["", mix_title(name, mix, mode_of(mix, results)), "", *batching_table(mix), "", *grid_table(mix), ""]
        parts += against_table(mix)
    parts += ["", "Goals (at mean - sd):", "", *goal_lines(results)]
    return "\n".join(parts)


def readme_block(results: dict) -> str:
    """The README's short form: each mix's final test tau and documents a second per batching, and the goals."""
    rows = []
    for name, mix in results["mixes"].items():
        entries = [mix["batchings"][each] for each in BATCHINGS]
        cells = [f"{pm(entry['final_tau'])} ({entry['documents'] / entry['train_s']:.0f} doc/s)" for entry in entries]
        gap = mix["against"][mix["strongest"]]["gap"]
        rows.append([f"{name} ({mode_of(mix, results)})", *cells, f"{pm(gap)} vs {mix['strongest']}"])
    lines = [
        f"{compare_command(results)} at {results['commit']}, "
        "mean ± sd over training seeds, greedy tau on the test prompts, learning rates chosen on dev:",
        "",
        *table(["mix", *BATCHINGS, "packed - strongest at equal time"], rows),
    ]
    return "\n".join([*lines, "", *goal_lines(results)])


def replace_block(text: str, block: str, where: str) -> str:
    pattern = re.compile(re.escape(MARKERS[0]) + r"\n.*?\n" + re.escape(MARKERS[1]), re.S)
    if not pattern.search(text):
        raise ValueError(f"{where} has no {MARKERS[0]} ... {MARKERS[1]} block to write the results into")
    return pattern.sub(lambda _: f"{MARKERS[0]}\n{block}\n{MARKERS[1]}", text, count=1)


def block_of(text: str, where: str) -> str:
    """The text between the ``packing-value`` markers of ``text``."""
    match = re.search(re.escape(MARKERS[0]) + r"\n(.*?)\n" + re.escape(MARKERS[1]), text, re.S)
    if match is None:
        raise ValueError(f"{where} has no {MARKERS[0]} ... {MARKERS[1]} block")
    return match.group(1)


def merge(published: dict, results: dict) -> dict:
    """The published results with the mixes of ``results`` measured anew, the others kept as they were.

    Each mix keeps the commit, minutes and protocol (``mode``: full or quick, which its title and the README
    state) it was measured at (``commit``, ``wall_s`` and ``mode`` of the mix, else of its run); the merged
    ``commit`` names each mix's when they differ, ``wall_s`` is their sum and ``mode`` is ``mixed`` when theirs
    differ.

    Raises:
        ValueError: when the two were measured under another learning-rate grid, machine or runs at once: such
            results replace the published ones whole or not at all.
    """
    for key in ("lr_grid", "machine", "jobs"):
        if published[key] != results[key]:
            raise ValueError(
                f"the published results have {key}={published[key]!r} and these {results[key]!r}: "
                "only results of the same protocol merge; run every mix to replace them"
            )

    def stamped(run: dict) -> dict:
        keys = ("commit", "wall_s", "mode")
        return {name: {**{key: run[key] for key in keys}, **mix} for name, mix in run["mixes"].items()}

    mixes = {**stamped(published), **stamped(results)}
    commits = [(name, mix["commit"]) for name, mix in mixes.items()]
    merged = {
        **results,
        "mixes": mixes,
        "commit": (
            commits[0][1]
            if len({commit for _, commit in commits}) == 1
            else ", ".join(f"{commit} ({name})" for name, commit in commits)
        ),
        "wall_s": sum(mix["wall_s"] for mix in mixes.values()),
        "mode": modes.pop() if len(modes := {mix["mode"] for mix in mixes.values()}) == 1 else "mixed",
    }
    return finish(merged)


def publish(results: dict) -> dict:
    """Keep the results in ``docs/compare/`` and write the tables into README.md and docs/packing.md.

    Results of some mixes only are merged into the published ones (``merge``): the other mixes keep theirs.

    Returns:
        The results published (merged where they were): what the picture of the docs must be drawn from."""
    if PUBLISHED.is_file():
        published = load_published()
        if set(published["mixes"]) - set(results["mixes"]):
            results = merge(published, results)
    PUBLISHED.parent.mkdir(parents=True, exist_ok=True)
    PUBLISHED.write_text(json.dumps(results, indent=1) + "\n")
    for path, block in ((REPO / "README.md", readme_block(results)), (REPO / "docs" / "packing.md", render(results))):
        path.write_text(replace_block(path.read_text(), block, str(path)))
    print(f"published: {PUBLISHED}, README.md, docs/packing.md")
    return results


def band(runs: list[dict], grid: int = 60) -> tuple[list[float], list[float], list[float]]:
    """Seconds, mean and sd of greedy tau over seeds, on a common grid up to the shortest run's end."""
    stop = min(end_s(run) for run in runs)
    xs = [stop * i / (grid - 1) for i in range(grid)]
    values = [[at(run["points"], x) for run in runs] for x in xs]
    return xs, [mean_sd(v)[0] for v in values], [mean_sd(v)[1] for v in values]


def draw(results: dict, path: Path = PICTURE) -> Path:
    """Greedy test tau against training seconds, mean over seeds with ± sd shaded (top), and each batching's dev
    tau over its learning-rate grid (bottom); one column a mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = results["mixes"]
    figure, axes = plt.subplots(2, len(mixes), figsize=(6.5 * len(mixes), 8), squeeze=False)
    colors = dict(zip(BATCHINGS, ("tab:blue", "tab:green", "tab:orange", "tab:red")))
    for column, (name, mix) in enumerate(mixes.items()):
        top, bottom = axes[0][column], axes[1][column]
        for batching in BATCHINGS:
            entry = mix["batchings"][batching]
            xs, mean, sd = band(entry["seeds"])
            label = f"{batching}: lr {entry['lr']:g}, {entry['epochs']} epochs, final {pm(entry['final_tau'])}"
            top.plot(xs, mean, color=colors[batching], label=label)
            top.fill_between(
                xs,
                [m - s for m, s in zip(mean, sd)],
                [m + s for m, s in zip(mean, sd)],
                color=colors[batching],
                alpha=0.2,
            )
            rates = [run["lr"] for run in entry["grid"]]
            bottom.plot(
                rates, [run["dev_tau"] for run in entry["grid"]], marker="o", color=colors[batching], label=batching
            )
            bottom.scatter(
                [entry["lr"]],
                [max(run["dev_tau"] for run in entry["grid"])],
                s=160,
                facecolors="none",
                edgecolors=colors[batching],
            )
        top.set_title(f"{name} mix: mean ± sd over {len(mix['seeds'])} seeds ({mode_of(mix, results)})")
        top.set_xlabel("training seconds (one core each; evaluations excluded)")
        top.set_ylabel("greedy tau, test prompts (exact)")
        top.grid(alpha=0.3)
        top.legend(fontsize=8)
        bottom.set_xscale("log")
        bottom.set_title(f"{name} mix: learning rate chosen on dev (circled)")
        bottom.set_xlabel("peak learning rate")
        bottom.set_ylabel("final greedy tau, dev prompts")
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def check_published(readme: str, packing_doc: str, results: dict) -> None:
    """Refuse README.md or docs/packing.md blocks that are not the stored results' rendering."""
    if block_of(readme, "README.md") != readme_block(results):
        raise ValueError("README.md's packing-value block is not docs/compare/packing_value.json's rendering")
    if block_of(packing_doc, "docs/packing.md") != render(results):
        raise ValueError("docs/packing.md's packing-value block is not docs/compare/packing_value.json's rendering")


def load_published() -> dict:
    return json.loads(PUBLISHED.read_text())


def main() -> None:
    """Print (and with ``--publish`` write) the report of a saved ``packing_value.json``, drawing its picture."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", nargs="?", default=str(REPO / "outputs" / "compare" / "packing_value.json"))
    parser.add_argument("--publish", action="store_true", help="write README.md, docs/packing.md, docs/compare/")
    options = parser.parse_args()
    results = finish(json.loads(Path(options.results).read_text()))
    print(render(results))
    print(f"\npicture: {draw(results)}")
    if options.publish:
        publish(results)


__all__ = ["against", "at", "finish", "first_reaching", "mean_sd", "render", "readme_block", "merge", "publish", "draw"]


if __name__ == "__main__":
    main()

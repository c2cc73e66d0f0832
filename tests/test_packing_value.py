"""``make compare``: its statistics and goals, its splits, and that the published numbers are the stored ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import packing_report  # noqa: E402
import packing_value  # noqa: E402


def run(points, lr=1e-2, seed=42, dev=2.0, **counters):
    base = {"train_s": points[-1][0], "captured_tokens": 100, "tokens": 80, "documents": 10, "supervised_slots": 50}
    return {"points": points, "lr": lr, "seed": seed, "dev_tau": dev, "step": 10, **base, **counters}


def test_curve_reading():
    points = [(0.0, 0, 1.0), (10.0, 5, 2.0), (20.0, 9, 3.0)]
    assert packing_report.at(points, 5.0) == 1.5
    assert packing_report.at(points, 99.0) == 3.0  # after the end: the final tau
    assert packing_report.first_reaching(points, 2.5) == 15.0
    assert packing_report.first_reaching(points, 3.5) is None
    assert packing_report.mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0)  # sd with n - 1


def test_against_is_seed_by_seed_at_the_shorter_runs_end():
    packed = [run([(0.0, 0, 1.0), (10.0, 0, 3.0)]), run([(0.0, 0, 1.0), (10.0, 0, 2.0)])]
    baseline = [run([(0.0, 0, 1.0), (20.0, 0, 2.0)]), run([(0.0, 0, 1.0), (20.0, 0, 2.0)])]
    row = packing_report.against(packed, baseline)
    # seed 0: at 10 s packed 3.0, baseline 1.5; seed 1: 2.0 against 1.5
    assert row["gap"] == pytest.approx((1.0, 0.7071067811865476))
    # packed reaches the baseline's final 2.0 at 5 s and 10 s of the baseline's 20
    assert row["ratio"] == pytest.approx((0.375, 0.1767766952966369))
    never = packing_report.against(packed, [run([(0.0, 0, 1.0), (20.0, 0, 9.0)])] * 2)
    assert never["ratio"] is None


def synthetic(gap: float, mixes=("demo",)) -> dict:
    """Results of two seeds a batching in which packed leads every baseline by ``gap`` at every point."""

    def entry(lift: float) -> dict:
        seeds = [run([(0.0, 0, 1.0), (10.0, 0, 2.0 + lift + 0.01 * s)], seed=42 + s) for s in range(2)]
        grid = [run(seeds[0]["points"], lr=lr, dev=dev) for lr, dev in ((5e-3, 2.0), (1e-2, 2.5), (2e-2, 2.1))]
        return {"epochs": 3, "epoch_s": None, "lr": 1e-2, "grid": grid, "seeds": seeds}

    mix = {
        "budget_s": 10.0,
        "token_budget": 1024,
        "seeds": [42, 43],
        "batchings": {name: entry(gap if name == "packed" else 0.0) for name in packing_report.BATCHINGS},
    }
    results = {"mode": "quick", "commit": "abc", "machine": "2 cores", "jobs": 2, "wall_s": 60.0, "lr_grid": []}
    results["mixes"] = {name: mix for name in mixes}
    return packing_report.finish(results)


def test_goals_are_judged_at_mean_minus_sd():
    ahead = synthetic(0.5)
    assert ahead["goals"]["not_behind"]["demo"]["met"]
    assert ahead["goals"]["half_time_on_long_tail"]["met"] is None  # not run: not claimed
    behind = synthetic(-0.2)
    assert not behind["goals"]["not_behind"]["demo"]["met"]
    long_tail = synthetic(3.0, mixes=("demo", packing_report.LONG_TAILED))
    # packed reaches the baselines' final 2.0x at about a quarter of their time
    assert long_tail["goals"]["half_time_on_long_tail"]["met"]
    text = packing_report.render(ahead)
    assert "| lr 0.005 | lr 0.01 | lr 0.02 |" in text and "**2.50**" in text  # the grid, the chosen rate bold
    assert "met" in packing_report.readme_block(ahead)


def test_runs_are_scored_on_test_in_the_run_and_on_dev_only_at_their_end(tmp_path):
    data = {name: tmp_path / f"{name}.jsonl" for name in ("train", "test", "dev")}
    shape = packing_value.Shape(128, 0, 8, 100)
    job = packing_value.Job("demo", "grouped", 1e-2, 43, 3, shape, data)
    arguments = packing_value.overrides(job, data["train"])
    assert f"--recipe_args.val_data_path={data['test']}" in arguments
    assert not any(str(data["dev"]) in argument for argument in arguments)
    assert "--recipe_args.shuffle_seed=43" in arguments and "--recipe_args.batching=grouped" in arguments
    command = packing_value.dev_command(job)
    assert command[command.index("--data") + 1] == str(data["dev"])


def test_a_baseline_stops_at_the_budget_inside_an_epoch(tmp_path):
    """The longtail compare's first seed gave baselines whole epochs: upstream trained 461 s against packed's 132 s
    budget (600 steps of 767 ms). A baseline now trains the steps the budget holds, inside an epoch, with its
    in-run evaluations spread over those steps."""
    assert packing_value.within_budget(132.0, 0.767, 600) == (172, 1)
    assert packing_value.within_budget(132.0, 0.553, 161) == (239, 2)  # dynamic: into its second epoch
    assert packing_value.within_budget(1.0, 5.0, 10) == (1, 1)
    with pytest.raises(ValueError, match="s a step"):
        packing_value.within_budget(1.0, 0.0, 10)
    shape = packing_value.Shape(2048, 0, 1, 600)
    job = packing_value.Job("longtail", "upstream", 2e-2, 42, 1, shape, {"test": tmp_path / "val.jsonl"}, max_steps=172)
    arguments = packing_value.overrides(job, tmp_path / "train.jsonl")
    assert "--recipe_args.max_steps=172" in arguments and "--recipe_args.num_epochs=1" in arguments
    assert f"--recipe_args.eval_every_steps={172 // packing_value.EVALS}" in arguments
    packed = packing_value.Job("longtail", "packed", 2e-2, 42, 2, shape, {"test": tmp_path / "val.jsonl"})
    assert not any("max_steps" in argument for argument in packing_value.overrides(packed, tmp_path / "t.jsonl"))


def test_quick_runs_one_demo_epoch_with_fewer_evaluations(tmp_path):
    """``--quick`` (15 minutes on 2 cores): the demo mix's packed runs train one epoch and evaluate on test at 0, a
    third, two thirds and the end; the full protocol keeps its epochs and six evaluations a run."""
    assert packing_value.MIXES["demo"].quick_epochs == 1 and packing_value.MIXES["demo"].epochs == 5
    shape = packing_value.Shape(128, 128, 8, 150)
    data = {"test": tmp_path / "val.jsonl"}
    quick = packing_value.Job("demo", "packed", 1e-2, 42, 1, shape, data, evals=packing_value.QUICK_EVALS)
    assert "--recipe_args.eval_every_steps=50" in packing_value.overrides(quick, tmp_path / "train.jsonl")
    full = packing_value.Job("demo", "packed", 1e-2, 42, 5, shape, data)
    assert "--recipe_args.eval_every_steps=125" in packing_value.overrides(full, tmp_path / "train.jsonl")


def test_resume_keeps_finished_runs_of_the_same_commands_only(tmp_path, monkeypatch):
    """``--resume`` after a stopped ``make compare``: a run whose ``summary.json`` records the same commands, code and
    data is not run again; a killed run (no summary), one with other settings (here ``max_steps``), other data or
    other code is."""
    monkeypatch.setattr(packing_value, "OUT", tmp_path / "compare")
    launched = []

    def fake(command, core, log):
        output = log.parent
        if "nemo_automodel_ext.launch" in command:
            launched.append(command)
            counts = {"captured_tokens": 10, "tokens": 8, "documents": 2, "supervised_slots": 5}
            records = [{"step": 1, "train_s": 1.0, **counts}, {"step": 2, "train_s": 2.0, **counts}]
            records.append({"split": "val", "step": 2, "greedy_tau": 2.5, "train_s": 2.0, **counts})
            (output / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        else:
            (output / "dev_eval.json").write_text(json.dumps({"greedy": {"epoch_1_step_2": {"tau": 2.25}}}))

    monkeypatch.setattr(packing_value, "pinned", fake)
    data = {name: tmp_path / f"{name}.jsonl" for name in ("train", "test", "dev")}
    for path in data.values():
        path.write_text('{"messages": []}\n')
    job = packing_value.Job("demo", "dynamic", 1e-2, 42, 1, packing_value.Shape(128, 0, 8, 10), data, max_steps=7)
    cores = packing_value.Cores(1)
    first = packing_value.train(job, cores, resume=True)
    assert len(launched) == 1 and first["dev_tau"] == 2.25 and (job.output / "summary.json").exists()
    again = packing_value.train(job, cores, resume=True)
    assert len(launched) == 1 and again["reused"] and again["points"] == [list(point) for point in first["points"]]
    packing_value.train(job, cores)  # without --resume: always run
    assert len(launched) == 2
    other = packing_value.Job("demo", "dynamic", 1e-2, 42, 1, job.shape, data, max_steps=8)  # the same folder
    packing_value.train(other, cores, resume=True)
    assert len(launched) == 3 and "--recipe_args.max_steps=8" in launched[-1]
    (other.output / "summary.json").unlink()  # as a run killed before its end leaves it
    packing_value.train(other, cores, resume=True)
    assert len(launched) == 4
    data["dev"].write_text('{"messages": [{"role": "user", "content": "regenerated"}]}\n')  # other data
    packing_value.train(other, cores, resume=True)
    assert len(launched) == 5
    monkeypatch.setattr(packing_value, "code_state", lambda: "0000000+changes:feedface")  # other code
    packing_value.train(other, cores, resume=True)
    assert len(launched) == 6


def test_every_batching_gets_the_same_token_budget():
    counted = [20, 30, 40, 12] * 50
    mix = packing_value.MIXES["demo"]
    budget = mix.row * mix.rows
    for batching in packing_report.BATCHINGS:
        shape = packing_value.shape(batching, mix, counted, 48)
        rows = shape.micro_batch_size
        width = shape.packed_sequence_size or shape.seq_length
        assert budget - 48 < rows * width <= budget if batching == "upstream" else rows * width == budget


def test_readme_and_docs_carry_the_stored_results():
    """README.md's and docs/packing.md's tables are the rendering of docs/compare/packing_value.json."""
    results = packing_report.load_published()
    packing_report.check_published(
        (REPO / "README.md").read_text(), (REPO / "docs" / "packing.md").read_text(), results
    )
    with pytest.raises(ValueError, match="README.md's packing-value block"):
        edited = dict(results, commit="0000000")
        packing_report.check_published((REPO / "README.md").read_text(), "", edited)


def test_a_probe_with_one_logged_step_still_times_its_steps(tmp_path):
    """The full run's skewed grouped probe logged one step (10 steps on a quarter of the data); its seconds a step
    were 0 and the epoch budget divided by zero. One logged record now gives its own seconds over its steps."""
    import json

    records = [{"step": 10, "train_s": 4.0, "captured_tokens": 9, "tokens": 8, "documents": 3, "supervised_slots": 5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert packing_value.summarise(tmp_path)["step_s"] == pytest.approx(0.4)
    records.append({**records[0], "step": 30, "train_s": 8.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert packing_value.summarise(tmp_path)["step_s"] == pytest.approx(0.2)


def test_a_probe_logs_every_step_so_its_step_time_leaves_start_up_out(tmp_path):
    """A probe of a few steps under the recipe's ``log_every_steps: 10`` logged one record, start-up included: the
    skewed grouped probe measured 0.6 s a step for 0.2, and grouped trained a third of the time budget. The probe
    logs every step (its step time then comes from two records); the measured runs keep the recipe's frequency."""
    shape = packing_value.Shape(512, 0, 2, 58)
    probe = packing_value.Job("skewed", "grouped", 5e-3, 42, 1, shape, {"test": tmp_path / "val.jsonl"}, probe=True)
    run = packing_value.Job("skewed", "grouped", 5e-3, 42, 4, shape, {"test": tmp_path / "val.jsonl"})
    assert "--recipe_args.log_every_steps=1" in packing_value.overrides(probe, tmp_path / "probe.jsonl")
    assert not any("log_every_steps" in each for each in packing_value.overrides(run, tmp_path / "train.jsonl"))


def test_publishing_one_mix_keeps_the_others_with_the_commit_each_was_measured_at():
    """``--mix skewed --publish`` replaces the skewed mix only: demo keeps its numbers and its commit."""
    import copy

    published = packing_report.load_published()
    rerun = copy.deepcopy(published)
    rerun["mixes"] = {"skewed": rerun["mixes"]["skewed"]}
    rerun["mixes"]["skewed"].update(budget_s=999.0, commit="abcdef0", wall_s=600.0)  # as packing_value stamps it
    rerun["mixes"]["skewed"].pop("mode")  # a fresh run states its protocol once, for all its mixes
    rerun.update(commit="abcdef0", wall_s=600.0)
    merged = packing_report.merge(published, rerun)
    assert list(merged["mixes"]) == list(published["mixes"])
    assert (
        merged["mixes"]["demo"]["batchings"]
        == packing_report.finish(copy.deepcopy(published))["mixes"]["demo"]["batchings"]
    )
    assert merged["mixes"]["skewed"]["budget_s"] == 999.0
    demo = published["mixes"]["demo"]
    assert merged["mixes"]["demo"]["commit"] == demo["commit"]
    assert merged["mixes"]["skewed"]["commit"] == "abcdef0"
    others = {name: mix for name, mix in published["mixes"].items() if name != "skewed"}
    stamps = [
        f"{mix['commit']} ({name})" if name != "skewed" else "abcdef0 (skewed)" for name, mix in merged["mixes"].items()
    ]
    assert merged["commit"] == ", ".join(stamps)
    assert merged["wall_s"] == pytest.approx(sum(mix["wall_s"] for mix in others.values()) + 600.0)
    assert "at abcdef0, 10 min" in packing_report.render(merged)
    with pytest.raises(ValueError, match="jobs=2.*4"):
        packing_report.merge(published, dict(rerun, jobs=4))
    # A mix measured under the quick protocol keeps it, in its title and the README's row; the others keep theirs.
    quick = packing_report.merge(published, dict(rerun, mode="quick"))
    assert [quick["mixes"][name]["mode"] for name in ("demo", "skewed")] == ["full", "quick"]
    assert quick["mode"] == "mixed"
    assert "**skewed** mix (quick: 3 seeds" in packing_report.render(quick)
    assert "**demo** mix (full: 3 seeds" in packing_report.render(quick)
    readme = packing_report.readme_block(quick)
    assert "| skewed (quick) |" in readme and "| demo (full) |" in readme
    assert readme.startswith("`make compare` and `make compare COMPARE_ARGS=--quick` at ")


def test_a_run_without_publish_leaves_the_docs_picture_alone(tmp_path, monkeypatch):
    """``make compare COMPARE_ARGS=--quick`` (no ``--publish``) once redrew ``docs/images/packed_vs_unpacked.png``
    from its own run, under the docs' tables of other runs: its picture now goes beside its results."""
    import copy

    monkeypatch.setattr(packing_value, "OUT", tmp_path / "compare")
    docs_picture = packing_report.PICTURE.read_bytes()
    published = {name: (REPO / name).read_text() for name in ("README.md", "docs/packing.md")}
    results = copy.deepcopy(packing_report.load_published())
    results["mixes"] = {"demo": results["mixes"]["demo"]}
    saved, picture = packing_value.report(results, publish=False)
    assert saved == tmp_path / "compare" / "packing_value.json" and json.loads(saved.read_text())["mixes"].keys() == {
        "demo"
    }
    assert picture == tmp_path / "compare" / packing_report.PICTURE.name and picture.stat().st_size > 10_000
    assert packing_report.PICTURE.read_bytes() == docs_picture
    assert all((REPO / name).read_text() == text for name, text in published.items())


def test_publishing_one_mix_returns_every_mix_for_the_picture(tmp_path, monkeypatch):
    """``publish`` returns the merged results, which ``packing_value.main`` draws: a run of the skewed mix alone
    once drew a picture without the demo mix beside tables that still had it."""
    import copy

    for name in ("README.md", "docs/packing.md", "docs/compare/packing_value.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((REPO / name).read_text())
    monkeypatch.setattr(packing_report, "REPO", tmp_path)
    monkeypatch.setattr(packing_report, "PUBLISHED", tmp_path / "docs/compare/packing_value.json")
    rerun = copy.deepcopy(packing_report.load_published())
    rerun["mixes"] = {"skewed": rerun["mixes"]["skewed"]}
    rerun["mixes"]["skewed"].update(commit="abcdef0", wall_s=600.0)
    rerun.update(commit="abcdef0", wall_s=600.0)
    drawn = packing_report.publish(rerun)
    assert list(drawn["mixes"]) == list(packing_report.load_published()["mixes"]) and len(drawn["mixes"]) > 1
    assert "abcdef0 (skewed)" in (tmp_path / "README.md").read_text()
    assert json.loads(json.dumps(drawn)) == packing_report.load_published()  # what was written, tuples as lists

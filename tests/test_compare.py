"""``dapo compare``: several runs' signals overlaid in one figure, their final figures in a
table, and a clear error for a path that is not a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dapo import cli
from dapo.metrics import MetricsLogger
from dapo.metrics.compare import SIGNALS, build_figure, default_labels, load_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _step(step: int, lift: float) -> dict[str, float]:
    """One step's metrics as the trainer logs them (more keys than compared), ``lift``
    setting the run apart."""
    return {
        "reward/mean": -0.4 + lift * step,
        "reward/std": 0.9,
        "reward/acc": 0.3 + lift * step / 2,
        "response_length/mean": 40.0 - step - 10 * lift,
        "response_length/max": 64.0,
        "response_length/clip_ratio": 0.0,
        "actor/entropy": 0.5 - lift * step,
        "actor/gen_prob": 0.8 + lift * step / 4,
        "actor/clip_frac_low": 0.0002 * step,
        "actor/clip_frac_high": 0.001 + lift * step / 100,
        "actor/ppo_kl": 1e-5,
        "actor/grad_norm": 0.3,
        "sampling/gen_rounds": 1.0,
        "sampling/carried_over": 2.0,
        "perf/step_s": 1.0,
    }


def _write_run(
    path: Path, steps: int, lift: float, before: float, after: float, drop: str = ""
) -> list[dict]:
    """A run's metrics.jsonl as the trainer writes it: held-out accuracy at step 0, the
    steps, then the final held-out accuracy as a second record of the last step. Returns
    the steps' metrics."""
    logged = []
    with MetricsLogger(path, total_steps=steps, console=False, tensorboard=False) as log:
        log.log(0, {"val/acc": before})
        for step in range(1, steps + 1):
            metrics = {k: v for k, v in _step(step, lift).items() if k != drop}
            log.log(step, metrics)
            logged.append(metrics)
        log.log(steps, {"val/acc": after})
    return logged


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path, list[dict], list[dict]]:
    """``grpo`` (5 steps) and ``dapo`` (4 steps, no actor/gen_prob logged)."""
    grpo, dapo = tmp_path / "grpo", tmp_path / "dapo"
    steps_grpo = _write_run(grpo, 5, 0.02, 0.40, 0.52)
    steps_dapo = _write_run(dapo, 4, 0.05, 0.41, 0.63, drop="actor/gen_prob")
    return grpo, dapo, steps_grpo, steps_dapo


def _axes_by_title(fig: Any) -> dict[str, Any]:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_each_panel_holds_one_line_per_run_with_its_data(two_runs: tuple) -> None:
    grpo, dapo, steps_grpo, steps_dapo = two_runs
    runs = load_runs([grpo, dapo])
    assert [r.label for r in runs] == ["grpo", "dapo"]
    axes = _axes_by_title(build_figure(runs))
    assert set(axes) == {s.title for s in SIGNALS}
    for signal in SIGNALS:
        lines = {line.get_label(): line for line in axes[signal.title].lines}
        if signal.key == "val/acc":  # before training, and the last evaluation
            expected = {"grpo": ([0, 5], [0.40, 0.52]), "dapo": ([0, 4], [0.41, 0.63])}
        else:
            expected = {
                label: (list(range(1, len(steps) + 1)), [m[signal.key] for m in steps])
                for label, steps in (("grpo", steps_grpo), ("dapo", steps_dapo))
                if signal.key in steps[0]
            }
        assert list(lines) == list(expected), signal.key
        for label, (xs, ys) in expected.items():
            got_x, got_y = lines[label].get_data()
            assert list(got_x) == xs and list(got_y) == pytest.approx(ys), (signal.key, label)
    # The run that did not log actor/gen_prob is left out of that panel only.
    assert [line.get_label() for line in axes["Generation probability"].lines] == ["grpo"]
    # A run keeps its colour in every panel.
    colours = {line.get_label(): {line.get_color()} for ax in axes.values() for line in ax.lines}
    assert all(len(c) == 1 for c in colours.values())
    # Clip fractions of 0.1-0.2% fill their panel (the axis is fitted from 0).
    assert axes["Clip fraction, high"].get_ylim()[1] < 0.01


def test_dapo_compare_writes_the_png_and_prints_the_final_figures(
    two_runs: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grpo, dapo, steps_grpo, steps_dapo = two_runs
    out = tmp_path / "figs" / "ladder.png"
    assert cli.main(["compare", str(grpo), str(dapo), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    printed = capsys.readouterr().out.splitlines()
    head, row_grpo, row_dapo, where = printed
    assert head.split()[:4] == ["run", "steps", "train", "acc"]
    assert where == f"figure: {out}"
    last_grpo, last_dapo = steps_grpo[-1], steps_dapo[-1]
    assert row_grpo.split() == [
        "grpo",
        "5",
        f"{last_grpo['reward/acc']:.1%}",
        "52.0%",  # the last evaluation, not step 0's
        f"{last_grpo['reward/mean']:+.3f}",
        f"{last_grpo['response_length/mean']:.1f}",
        f"{last_grpo['actor/entropy']:.3f}",
        f"{last_grpo['actor/gen_prob']:.3f}",
        f"{last_grpo['actor/clip_frac_low']:.3%}",
        f"{last_grpo['actor/clip_frac_high']:.3%}",
    ]
    assert row_dapo.split() == [
        "dapo",
        "4",
        f"{last_dapo['reward/acc']:.1%}",
        "63.0%",
        f"{last_dapo['reward/mean']:+.3f}",
        f"{last_dapo['response_length/mean']:.1f}",
        f"{last_dapo['actor/entropy']:.3f}",
        "-",  # not logged
        f"{last_dapo['actor/clip_frac_low']:.3%}",
        f"{last_dapo['actor/clip_frac_high']:.3%}",
    ]


def test_default_output_is_compare_png_here_and_labels_can_be_given(
    two_runs: tuple,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    grpo, dapo, *_ = two_runs
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    argv = ["compare", str(grpo / "metrics.jsonl"), str(dapo), "--labels", "GRPO", "DAPO"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert (here / "compare.png").read_bytes()[:8] == PNG_SIGNATURE
    assert f"figure: {here / 'compare.png'}" in printed
    assert [line.split()[0] for line in printed.splitlines()[1:3]] == ["GRPO", "DAPO"]
    with pytest.raises(SystemExit) as stop:  # one label for two runs
        cli.main(["compare", str(grpo), str(dapo), "--labels", "GRPO"])
    assert stop.value.code == 2
    assert "1 labels for 2 runs" in capsys.readouterr().err


def test_runs_of_the_same_name_are_labelled_by_their_parents(tmp_path: Path) -> None:
    """The ablation scripts write PRESET/seed0 for every preset."""
    paths = [tmp_path / "grpo" / "seed0", tmp_path / "dapo" / "seed0", tmp_path / "x" / "a"]
    assert default_labels(paths) == ["grpo/seed0", "dapo/seed0", "x/a"]


def test_a_path_that_is_not_a_run_is_named_with_the_fix(
    two_runs: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grpo, *_ = two_runs
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    out = tmp_path / "c.png"
    assert cli.main(["compare", str(grpo), str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{empty} is not a run directory: it holds no metrics.jsonl" in err
    assert "Give the output_dir of a dapo train run" in err
    assert not out.exists()
    assert cli.main(["compare", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err

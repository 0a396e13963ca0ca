"""Tests for dapo.metrics: JSONL log, resume, TensorBoard, W&B, console and dashboard."""

from __future__ import annotations

import json
import math
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dapo import atomic
from dapo.metrics import (
    PG_LOSS_NOTE,
    MetricsLogger,
    console,
    dashboard,
    plot_dashboard,
    read_metrics,
)
from dapo.metrics import logger as logger_module

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _strict_loads(line: str) -> dict:
    """json.loads that rejects the non-standard NaN/Infinity tokens."""

    def reject(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=reject)


def _logger(tmp_path: Path, **kwargs) -> MetricsLogger:
    kwargs.setdefault("total_steps", 10)
    kwargs.setdefault("console", False)
    kwargs.setdefault("tensorboard", False)
    return MetricsLogger(tmp_path, **kwargs)


def _write_lines(path: Path, records: list[dict], torn: str | None = None) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if torn is not None:
        text += torn
    path.write_text(text)


def _synthetic_record(step: int) -> dict[str, float]:
    return {
        "reward/mean": -0.5 + step / 30,
        "reward/std": 0.8,
        "reward/acc": step / 40,
        "reward/overlong_penalty_mean": -0.01,
        "response_length/mean": 400 + 10 * step,
        "response_length/max": 1024,
        "response_length/clip_ratio": 0.05,
        "actor/entropy": 0.5 + 0.01 * math.sin(step),
        "actor/gen_prob": 0.8,
        "actor/clip_frac_low": 0.001,
        "actor/clip_frac_high": 0.004,
        "actor/ppo_kl": 1e-4,
        "actor/pg_loss": 0.01,
        "actor/grad_norm": 0.3,
        "sampling/all_correct_frac": 0.1,
        "sampling/all_wrong_frac": 0.4,
        "sampling/wasted_frac": 0.2,
        "sampling/gen_rounds": 1 + step % 3,
        "perf/rollout_tokens_per_s": 5000.0,
        "perf/train_tokens_per_s": 9000.0,
        "perf/step_s": 40.0,
    }


# --------------------------------------------------------------------------- JSONL


def test_jsonl_round_trip_with_tensor_numpy_and_nonfinite(tmp_path: Path) -> None:
    before = time.time()
    with _logger(tmp_path) as lg:
        lg.log(1, {"reward/mean": 0.25, "perf/step_s": 3, "actor/entropy": torch.tensor(0.5)})
        lg.log(
            2,
            {
                "reward/mean": np.float32(0.75),
                "sampling/gen_rounds": np.int64(3),
                "actor/grad_norm": torch.tensor([1.5], dtype=torch.float64),
                "actor/pg_loss": float("nan"),
                "actor/ppo_kl": float("inf"),
                "reward/min": torch.tensor(-math.inf),
            },
        )

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    raw = [_strict_loads(line) for line in lines]  # every line is strict JSON
    assert raw[1]["actor/pg_loss"] == "nan" and raw[1]["actor/ppo_kl"] == "inf"
    assert raw[1]["reward/min"] == "-inf"

    for path in (tmp_path, tmp_path / "metrics.jsonl"):
        recs = read_metrics(path)
        assert [r["step"] for r in recs] == [1, 2]
        assert all(before <= r["time"] <= time.time() for r in recs)
        assert recs[0]["reward/mean"] == 0.25
        assert recs[0]["perf/step_s"] == 3.0
        assert recs[0]["actor/entropy"] == 0.5 and type(recs[0]["actor/entropy"]) is float
        assert recs[1]["reward/mean"] == pytest.approx(0.75)
        assert recs[1]["sampling/gen_rounds"] == 3.0
        assert recs[1]["actor/grad_norm"] == 1.5
        assert math.isnan(recs[1]["actor/pg_loss"])
        assert recs[1]["actor/ppo_kl"] == math.inf
        assert recs[1]["reward/min"] == -math.inf
        assert "actor/entropy" not in recs[1]


def test_each_line_is_flushed_before_close(tmp_path: Path) -> None:
    lg = _logger(tmp_path)
    lg.log(1, {"reward/mean": 1.0})
    # A second reader (or a crash right now) sees the complete line.
    assert read_metrics(tmp_path) == [
        {"step": 1, "time": read_metrics(tmp_path)[0]["time"], "reward/mean": 1.0}
    ]
    lg.log(2, {"reward/mean": 2.0})
    assert len(read_metrics(tmp_path)) == 2
    lg.close()
    lg.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        lg.log(3, {})


def test_non_scalar_values_are_rejected(tmp_path: Path) -> None:
    with _logger(tmp_path) as lg:
        with pytest.raises(TypeError, match="actor/entropy"):
            lg.log(1, {"actor/entropy": torch.ones(3)})
        with pytest.raises(TypeError, match="reward/mean"):
            lg.log(1, {"reward/mean": "high"})


def test_read_metrics_drops_torn_last_line_and_warns_on_corrupt_middle(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}], torn='{"step": 3, "a"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]

    path.write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
    with pytest.warns(RuntimeWarning, match="line 2"):
        assert [r["step"] for r in read_metrics(path)] == [1, 3]

    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_metrics(tmp_path / "nowhere")


def test_appending_after_torn_line_keeps_new_records_intact(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, [{"step": 1, "a": 1.0}], torn='{"step": 2, "a": 2')
    with _logger(tmp_path, resume_step=1) as lg:
        lg.log(2, {"a": 5.0})
    lines = path.read_text().splitlines()
    assert [_strict_loads(line)["a"] for line in lines] == [1.0, 5.0]  # torn fragment cut off


# --------------------------------------------------------------------------- resume


def test_resume_truncates_later_steps_and_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_lines(
        path, [{"step": s, "time": 0.0, "x": float(s)} for s in range(1, 6)], torn='{"step": 6, "x'
    )
    with _logger(tmp_path, resume_step=3) as lg:
        # Rewritten before any new record arrives.
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
        lg.log(4, {"x": 40.0})

    text = path.read_text()
    assert text.endswith("\n")
    recs = [_strict_loads(line) for line in text.splitlines()]
    assert [(r["step"], r["x"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp left


def test_resume_rewrite_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, [{"step": s} for s in range(1, 6)])
    original = path.read_bytes()

    def failing_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        _logger(tmp_path, resume_step=2)
    assert path.read_bytes() == original  # the old file is untouched on failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_resume_keeps_step_0_and_a_new_run_starts_an_empty_file(tmp_path: Path) -> None:
    """Step 0 (the held-out accuracy before training) survives a resume; a new run
    (resume_step=None) drops what an earlier run without checkpoints left, step 0 too."""
    path = tmp_path / "metrics.jsonl"
    stale = [{"step": 0, "val/acc": 0.37}] + [{"step": s, "x": float(s)} for s in range(1, 6)]
    _write_lines(path, stale)
    with _logger(tmp_path, resume_step=3) as lg:
        lg.log(4, {"x": 40.0})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    assert read_metrics(path)[0]["val/acc"] == 0.37

    _write_lines(path, stale)
    with _logger(tmp_path) as lg:
        assert path.read_text() == ""  # emptied before the first record
        lg.log(0, {"val/acc": 0.5})
        lg.log(1, {"x": 1.0})
    assert [(r["step"], r.get("val/acc")) for r in read_metrics(path)] == [(0, 0.5), (1, None)]


def test_new_run_hides_the_tensorboard_events_of_an_earlier_one(tmp_path: Path) -> None:
    with _logger(tmp_path, tensorboard=True) as lg:
        for step in range(0, 4):
            lg.log(step, {"val/acc": step / 10})
    time.sleep(1.05)  # event file names carry whole seconds; keep the two files ordered
    with _logger(tmp_path, tensorboard=True) as lg:
        lg.log(0, {"val/acc": 0.5})
    assert _tb_scalars(tmp_path / "tensorboard", "val/acc") == [(0, 0.5)]


def test_resume_without_existing_file(tmp_path: Path) -> None:
    with _logger(tmp_path / "run", resume_step=7) as lg:
        lg.log(8, {"x": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [8]


# --------------------------------------------------------------------------- disabled


def test_disabled_logger_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rank1"
    with MetricsLogger(
        out, total_steps=5, console=True, tensorboard=True, wandb=True, enabled=False
    ) as lg:
        lg.log(1, {"reward/mean": 1.0, "actor/pg_loss": 0.0})
        lg.message("hello")
    assert not out.exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


# --------------------------------------------------------------------------- TensorBoard


def _tb_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_scalars(tmp_path: Path) -> None:
    with _logger(tmp_path, tensorboard=True, config={"lr": 1e-6}) as lg:
        lg.log(1, {"reward/mean": 0.5, "actor/entropy": torch.tensor(0.25)})
        lg.log(2, {"reward/mean": 0.75})
    tb_dir = tmp_path / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    assert _tb_scalars(tb_dir, "reward/mean") == [(1, 0.5), (2, 0.75)]
    assert _tb_scalars(tb_dir, "actor/entropy") == [(1, 0.25)]


def test_tensorboard_resume_purges_orphaned_steps(tmp_path: Path) -> None:
    with _logger(tmp_path, tensorboard=True) as lg:
        for step in range(1, 6):
            lg.log(step, {"reward/mean": float(step)})
    time.sleep(1.05)  # event file names carry whole seconds; keep the two files ordered
    with _logger(tmp_path, tensorboard=True, resume_step=3) as lg:
        lg.log(4, {"reward/mean": 40.0})
    assert _tb_scalars(tmp_path / "tensorboard", "reward/mean") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]


def test_missing_tensorboard_warns_and_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    with pytest.warns(RuntimeWarning, match="TensorBoard logging disabled"):
        lg = _logger(tmp_path, tensorboard=True)
    with lg:
        lg.log(1, {"reward/mean": 1.0})
        lg.log(2, {"reward/mean": 2.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert not (tmp_path / "tensorboard").exists()


# --------------------------------------------------------------------------- W&B


def test_wandb_missing_raises_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import -> ImportError
    out = tmp_path / "run"
    with pytest.raises(RuntimeError) as info:
        _logger(out, wandb=True)
    message = str(info.value)
    assert "pip install wandb" in message
    assert "logging.wandb=false" in message
    assert not out.exists()  # failed before creating anything


def test_wandb_receives_config_and_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, data: dict, step: int | None = None) -> None:
            calls["log"].append((data, step))

        def finish(self) -> None:
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    config = {"algorithm": {"clip_high": 0.28}, "lr": 1e-6}
    with _logger(
        tmp_path, wandb=True, wandb_project="proj", wandb_run_name="run-7", config=config
    ) as lg:
        lg.log(1, {"reward/mean": np.float64(0.5), "actor/entropy": torch.tensor(0.3)})
        lg.log(2, {"reward/mean": 0.6})

    assert len(calls["init"]) == 1
    init_kwargs = calls["init"][0]
    assert init_kwargs["project"] == "proj"
    assert init_kwargs["name"] == "run-7"
    assert init_kwargs["config"] == config
    assert calls["log"] == [
        ({"reward/mean": 0.5, "actor/entropy": pytest.approx(0.3)}, 1),
        ({"reward/mean": 0.6}, 2),
    ]
    assert calls["finish"] == [True]


# --------------------------------------------------------------------------- console


def test_pg_loss_note_printed_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _logger(tmp_path, console=True, total_steps=5) as lg:
        lg.log(1, {"actor/pg_loss": 0.3})
        assert PG_LOSS_NOTE not in capsys.readouterr().err  # not near 0: no note
        lg.log(2, {"actor/pg_loss": 0.0})
        lg.log(3, {"actor/pg_loss": torch.tensor(1e-6)})
        lg.log(4, {"actor/pg_loss": -2e-5})
    err = capsys.readouterr().err
    assert err.count(PG_LOSS_NOTE) == 1


def test_pg_loss_note_not_printed_when_the_gradient_is_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _logger(tmp_path, console=True, total_steps=5) as lg:
        lg.log(1, {"actor/pg_loss": 0.0, "actor/grad_norm": 0.0})
        lg.log(2, {"actor/pg_loss": 0.0, "actor/grad_norm": float("nan")})
        assert PG_LOSS_NOTE not in capsys.readouterr().err  # "not zero" would be false
        lg.log(3, {"actor/pg_loss": 0.0, "actor/grad_norm": 0.25})
    assert capsys.readouterr().err.count(PG_LOSS_NOTE) == 1


# One rollout step of the default run as the trainer logs it (base run, step 3).
REALISTIC_STEP = {
    "reward/mean": 0.14391447368421054,
    "reward/std": 0.9937469959259033,
    "reward/acc": 0.5723684210526315,
    "reward/overlong_penalty_mean": -0.0008224,
    "response_length/mean": 31.61,
    "response_length/max": 50.0,
    "response_length/clip_ratio": 0.0,
    "reward/failures": 0.0,
    "perf/gen_s": 0.2548,
    "perf/score_s": 0.002375,
    "perf/rollout_tokens_per_s": 18857.0,
    "sampling/generated_samples_total": 432.0,
    "rollout/staleness": 0.0,
    "sampling/gen_rounds": 1.0,
    "sampling/generated_groups": 17.0,
    "sampling/all_correct_frac": 0.0,
    "sampling/all_wrong_frac": 0.11764705882352941,
    "sampling/uniform_groups": 0.11764705882352941,
    "sampling/carried_in": 0.0,
    "sampling/carried_over": 3.0,
    "sampling/wasted_frac": 0.11764705882352941,
    "sampling/short_batch": 0.0,
    "sampling/trained_groups": 16.0,
    "actor/clip_frac_low": 0.000243,
    "actor/clip_frac_high": 0.000243,
    "actor/ratio_mean": 0.9998,
    "actor/ppo_kl": 0.0002902,
    "actor/gen_prob": 0.962,
    "actor/entropy": 0.09004,
    "actor/pg_loss": -0.0357,
    "actor/loss": -0.0357,
    "actor/grad_norm": 0.2563,
    "actor/updates": 1.0,
    "actor/skipped_updates": 0.0,
    "actor/lr": 9e-05,
    "train/loss_tokens": 3987.0,
    "train/stale_groups": 0.0,
    "perf/train_s": 0.3455,
    "perf/train_tokens_per_s": 30620.0,
    "perf/step_s": 0.6029,
}


def _err_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


def test_compact_line_of_a_realistic_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with _logger(tmp_path, console=True, total_steps=300) as lg:
        # 2 minutes for the first step: 299 more take 9 h 58 min. The clock is frozen so
        # that a loaded machine's slower logging cannot move the eta by a second.
        now = time.time()
        lg._t0 = now - 120
        monkeypatch.setattr(logger_module, "time", types.SimpleNamespace(time=lambda: now))
        lg.log(1, REALISTIC_STEP)
        (line,) = [x for x in _err_lines(capsys) if x.startswith("step ")]
    # Formatted by hand: 57.24%, +0.1439, 0.09004, 31.61 tokens, 0.0243% of tokens
    # clipped high, 2 of 17 groups uniform, 0.6029 s.
    assert line == (
        "step   1/300  acc 57.2%  reward +0.144  entropy 0.09  len 32  clip-high 0.024%  "
        "uniform 12%  0.60s/step  02:00 eta 9:58:00"
    )
    assert len(line) <= console.MAX_LINE
    # Every metric still reaches metrics.jsonl, not only the printed ones.
    (rec,) = read_metrics(tmp_path)
    assert {k: v for k, v in rec.items() if k not in ("step", "time")} == REALISTIC_STEP


def test_compact_line_stays_short_for_extreme_values() -> None:
    values = {
        "val/acc": 1.0,
        "reward/acc": 1.0,
        "reward/mean": -12345.678,
        "actor/entropy": 1.2345678e-05,
        "response_length/mean": 131072.4,
        "actor/clip_frac_high": 0.123456,
        "sampling/uniform_groups": 1.0,
        "perf/step_s": 9999.4,
    }
    # The widest of every field at once, and 10,000 steps of which 1,000 took 100 hours.
    clock = console.timing(360_000.0, 1000, 9000)
    assert clock == "100:00:00 eta 900:00:00"
    line = console.compact_line(1000, 10_000, values, clock)
    assert line.startswith("step  1000/10000  val-acc 100.0%  acc 100.0%  reward -1.23e+04")
    assert len(line) <= console.MAX_LINE, (len(line), line)
    nonfinite = console.signals({"reward/mean": math.nan, "actor/entropy": math.inf})
    assert nonfinite == "reward nan  entropy inf"


def test_compact_line_shows_turns_and_non_zero_failures() -> None:
    values = {"reward/acc": 0.5, "env/turns_mean": 2.25, "perf/step_s": 1.5}
    line = console.compact_line(3, 10, {**values, "reward/failures": 0.0, "env/failures": 0.0}, "")
    assert line == "step  3/10  acc 50.0%  turns 2.25  1.50s/step"  # no failures: not shown
    line = console.compact_line(3, 10, {**values, "reward/failures": 7.0, "env/failures": 2.0}, "")
    assert line == "step  3/10  acc 50.0%  turns 2.25  1.50s/step  failed reward 7 env 2"
    assert console.failures({"env/failures": 1.0, "reward/failures": 0.0}) == "failed env 1"
    widest = {
        "val/acc": 1.0,
        "reward/acc": 1.0,
        "reward/mean": -12345.678,
        "actor/entropy": 1.2345678e-05,
        "response_length/mean": 131072.4,
        "actor/clip_frac_high": 0.123456,
        "sampling/uniform_groups": 1.0,
        "perf/step_s": 9999.4,
        "env/turns_mean": 12.345,
        "distill/reverse_kl": 1.2345678e-05,
        "reward/failures": 999999.0,
        "env/failures": 99999.0,
    }
    line = console.compact_line(1000, 10_000, widest, console.timing(360_000.0, 1000, 9000))
    assert len(line) <= console.MAX_LINE, (len(line), line)


def test_compact_line_shows_the_reverse_kl_to_a_teacher() -> None:
    values = {"reward/acc": 0.5, "actor/entropy": 0.25, "distill/reverse_kl": 0.0123456}
    line = console.compact_line(3, 10, values, "")
    assert line == "step  3/10  acc 50.0%  entropy 0.25  kl-teacher 0.0123"


def test_compact_line_leaves_out_missing_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_update = {
        "reward/acc": 0.0,
        "reward/mean": -1.0,
        "response_length/mean": 48.0,
        "sampling/all_correct_frac": 0.0,
        "sampling/all_wrong_frac": 1.0,
        "perf/step_s": 1.5,
    }
    with _logger(tmp_path, console=True, total_steps=2) as lg:
        lg.log(0, {"val/acc": 0.37})  # the evaluation before training
        lg.log(1, no_update)  # dynamic sampling found no group with a signal: no update
        lg.log(2, {})  # nothing at all
        lg.log(2, {"val/acc": 0.454})  # the evaluation after training
    lines = [x for x in _err_lines(capsys) if x.startswith("step ")]
    assert [x.split("  ")[:-1] for x in lines] == [
        ["step 0/2", "val-acc 37.0%"],
        ["step 1/2", "acc 0.0%", "reward -1", "len 48", "uniform 100%", "1.50s/step"],
        ["step 2/2"],
        ["step 2/2", "val-acc 45.4%"],
    ]


def test_console_prints_first_step_every_tenth_evaluations_and_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _logger(tmp_path, console=True, total_steps=20, resume_step=0) as lg:
        lg.log(0, {"val/acc": 0.25})
        for step in range(1, 21):
            extra = {"val/acc": 0.5} if step == 5 else {}
            lg.log(
                step,
                {
                    "reward/mean": 0.5,
                    "reward/acc": 0.25,
                    "response_length/mean": 812,
                    "actor/entropy": 0.4,
                    "perf/step_s": 12.5,
                    **extra,
                },
            )
        lg.message("checkpoint saved")
    lines = _err_lines(capsys)
    # stderr is not a TTY here: plain lines only, no carriage returns or escape codes.
    assert not any("\r" in x or "\x1b" in x for x in lines)
    printed = [x for x in lines if x.startswith("step ")]
    # step 0, the first step, every 10% (2 steps), the evaluation at 5 and the last one
    assert [x.split()[1] for x in printed] == [
        "0/20",
        "1/20",
        "2/20",
        "4/20",
        "5/20",
        "6/20",
        "8/20",
        "10/20",
        "12/20",
        "14/20",
        "16/20",
        "18/20",
        "20/20",
    ]
    assert printed[-1].startswith(
        "step 20/20  acc 25.0%  reward +0.5  entropy 0.4  len 812  12.5s/step  "
    )
    assert "val-acc 50.0%" in printed[4]
    assert all(len(x) <= console.MAX_LINE for x in lines)
    bar_lines = [x for x in lines if x.startswith("dapo:")]
    assert bar_lines and "20/20" in bar_lines[-1]
    assert "checkpoint saved" in lines


def test_verbose_prints_every_metric_of_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _logger(tmp_path, console=True, total_steps=50, verbose=True) as lg:
        for step in (1, 2, 3):
            lg.log(step, REALISTIC_STEP)
    lines = _err_lines(capsys)
    starts = [i for i, x in enumerate(lines) if x.startswith("step ")]
    assert [lines[i].split()[1] for i in starts] == ["1/50", "2/50", "3/50"]
    groups = {k.rpartition("/")[0] for k in REALISTIC_STEP}
    for i in starts:
        block = lines[i + 1 : i + 1 + len(groups)]
        by_group = dict(x.strip().split(": ", 1) for x in block)
        assert set(by_group) == groups
        for key, value in REALISTIC_STEP.items():
            group, _, name = key.rpartition("/")
            assert f"{name}={console.fmt_number(value)}" in by_group[group].split(), key
    assert len(read_metrics(tmp_path)) == 3


def test_tty_bar_prints_lines_and_warnings_above_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import warnings

    from dapo.metrics import logger as logger_mod

    fake_tty = io.StringIO()
    monkeypatch.setattr(logger_mod, "_isatty", lambda stream: True)
    monkeypatch.setattr(sys, "stderr", fake_tty)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = warnings.showwarning
        with _logger(tmp_path, console=True, total_steps=4) as lg:
            assert warnings.showwarning is not before
            for step in range(1, 5):
                lg.log(step, REALISTIC_STEP)
                warnings.warn(f"careful at {step}", UserWarning, stacklevel=1)
        assert warnings.showwarning is before  # restored
    out = fake_tty.getvalue()
    # tqdm.write clears the bar line ("\r", spaces, "\r") before each message, so every
    # message starts a line of its own on the terminal: nothing of the bar precedes it.
    shown = [line.rsplit("\r", 1)[-1] for line in out.split("\n")]
    assert sum(x.startswith("step ") for x in shown) == 4
    warned = [x for x in shown if "UserWarning: careful at" in x]
    assert len(warned) == 4 and all(x.startswith(__file__) for x in warned)
    assert "step/s, acc 57.2%  reward +0.144  entropy 0.09]" in out  # the bar's live figures


def test_message_prints_without_console(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _logger(tmp_path) as lg:
        lg.log(1, {"reward/mean": 1.0})
        lg.message("hello")
    assert capsys.readouterr().err == "hello\n"


# --------------------------------------------------------------------------- dashboard


def _write_run(run_dir: Path, steps: int, drop: tuple[str, ...] = ()) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            rec = {k: v for k, v in _synthetic_record(step).items() if not k.startswith(drop)}
            rec = {"step": step, "time": 1.0e9 + step, **rec}
            if step % 5 == 0 and "val" not in drop:
                rec["val/acc"] = step / 50
            f.write(json.dumps(rec) + "\n")


def _check_png(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = mpimg.imread(path)
    height, width = img.shape[:2]
    assert 800 <= width <= 4000 and 800 <= height <= 4000
    assert img.shape[2] in (3, 4)
    assert float(img[..., :3].std()) > 0.01  # not a blank canvas


def test_plot_dashboard_full(tmp_path: Path) -> None:
    run = tmp_path / "my-run"
    _write_run(run, 12)
    (run / "dashboard.png").write_bytes(b"stale")  # replaced atomically
    out = plot_dashboard(run)
    assert out == run / "dashboard.png"
    _check_png(out)
    assert sorted(p.name for p in run.iterdir()) == ["dashboard.png", "metrics.jsonl"]

    fig = dashboard._build_figure(read_metrics(run), "t")
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "no data" not in texts


def _legend_titles(fig: Any) -> list[str]:
    return [ax.get_legend().get_title().get_text() for ax in fig.axes if ax.get_legend()]


def test_an_episode_run_gets_an_episode_panel(tmp_path: Path) -> None:
    run = tmp_path / "episodes"
    _write_run(run, 4)
    assert "Episodes" not in _legend_titles(dashboard._build_figure(read_metrics(run), "t"))
    recs = read_metrics(run)
    for rec in recs:
        step = rec["step"]
        rec.update(
            {
                "env/turns_mean": 1.5 + step / 10,
                "env/tool_calls": 0.5,
                "env/failures": float(step % 2),
                "perf/env_s": 0.2,
                "env/ended_done": 0.75,
                "env/ended_max_turns": 0.25,
                "env/ended_budget": 0.0,
                "env/ended_env_failure": 0.0,
                "env/ended_bad_tool_call": 0.0,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    _check_png(plot_dashboard(run))
    fig = dashboard._build_figure(read_metrics(run), "t")
    titles = _legend_titles(fig)
    assert "Episodes" in titles and "Episode end reasons" in titles
    (episodes,) = [
        ax
        for ax in fig.axes
        if ax.get_legend() and ax.get_legend().get_title().get_text() == "Episodes"
    ]
    labels = [t.get_text() for t in episodes.get_legend().get_texts()]
    assert labels == [
        "turns / episode",
        "tool calls / episode",
        "environment failures (count)",
        "environment s",
    ]
    xs, ys = episodes.lines[0].get_data()
    assert list(xs) == [1, 2, 3, 4] and list(ys) == pytest.approx([1.6, 1.7, 1.8, 1.9])


def test_plot_dashboard_with_missing_keys(tmp_path: Path) -> None:
    run = tmp_path / "partial"
    _write_run(run, 6, drop=("sampling/", "perf/", "actor/gen_prob", "val"))
    recs = read_metrics(run)
    recs[2]["actor/entropy"] = "nan"  # as MetricsLogger writes non-finite values
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "rew')  # torn last line
    out = plot_dashboard(run / "metrics.jsonl", tmp_path / "sub" / "dash.png")
    assert out == tmp_path / "sub" / "dash.png"
    _check_png(out)

    fig = dashboard._build_figure(read_metrics(run), "t")
    # The non-finite values of the synthetic run are left out of the plotted lines.
    entropy_ax = fig.axes[2]
    xs, ys = entropy_ax.lines[0].get_data()
    assert list(xs) == [1, 2, 4, 5, 6] and all(math.isfinite(y) for y in ys)
    no_data = [
        ax.get_title() for ax in fig.axes if any(t.get_text() == "no data" for t in ax.texts)
    ]
    assert sorted(no_data) == [
        "Dynamic sampling",
        "Mean generation probability",
        "Throughput and step time",
    ]


def test_dashboard_draws_accuracy_before_and_after_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer logs val/acc at step 0 (before training) and, after the last step's
    record, the final val/acc as a second record of that step: both points are drawn, and
    the last step's training metrics are not lost to the second record."""
    run = tmp_path / "run"
    with MetricsLogger(run, total_steps=6, console=False, tensorboard=False) as lg:
        lg.log(0, {"val/acc": 0.37})
        for step in range(1, 7):
            lg.log(step, _synthetic_record(step))
        lg.log(6, {"val/acc": 0.454})
    figures = []
    build = dashboard._build_figure
    monkeypatch.setattr(
        dashboard, "_build_figure", lambda *a: figures.append(build(*a)) or figures[-1]
    )
    _check_png(plot_dashboard(run))
    (fig,) = figures
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    xs, ys = lines["val acc"].get_data()
    assert list(xs) == [0, 6] and list(ys) == [0.37, 0.454]
    xs, ys = lines["train acc"].get_data()
    assert list(xs) == [1, 2, 3, 4, 5, 6] and ys[-1] == _synthetic_record(6)["reward/acc"]
    assert fig.get_suptitle() == "run — 6 rollout steps"  # step 0 is no rollout step


def test_merge_steps_joins_the_records_of_a_step() -> None:
    records = [
        {"step": 2, "a": 1.0},
        {"step": 0, "v": 0.1},
        {"step": 2, "a": 3.0, "v": 0.5},
        {"step": "x"},
        {"b": 1},
    ]
    assert dashboard.merge_steps(records) == [
        {"step": 0, "v": 0.1},
        {"step": 2, "a": 3.0, "v": 0.5},
    ]


def test_plot_dashboard_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.jsonl")):
        plot_dashboard(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rew')  # only a torn line
    with pytest.raises(ValueError, match="no metric records"):
        plot_dashboard(tmp_path)
    assert not (tmp_path / "dashboard.png").exists()


def _several_updates_run(steps: int = 40) -> list[dict]:
    """Records as a run with four updates per rollout step logs them: clip fractions of
    0.02-0.3%, a PPO KL estimate of +-1e-4, throughput in the tens of thousands, a carried
    surplus."""
    records = []
    for step in range(1, steps + 1):
        rec = {
            **_synthetic_record(step),
            "step": step,
            "actor/clip_frac_low": 0.0002 + 0.0001 * (step % 3),
            "actor/clip_frac_high": 0.001 + 0.002 * (step % 2),
            "actor/ppo_kl": 1e-4 * math.sin(step),
            "perf/rollout_tokens_per_s": 17000.0 + 50 * step,
            "perf/train_tokens_per_s": 19000.0,
            "sampling/carried_in": float((step - 1) % 4),
            "sampling/carried_over": float(step % 4),
        }
        records.append(rec)
    return records


def _panel_lines(fig: Any, title: str) -> dict[str, Any]:
    """The labelled lines of the panel titled ``title``, its twin axis included."""
    (ax,) = [
        a for a in fig.axes if a.get_legend() and a.get_legend().get_title().get_text() == title
    ]
    return {
        line.get_label(): line
        for a in fig.axes
        if a.get_position().bounds == ax.get_position().bounds
        for line in a.lines
        if not line.get_label().startswith("_")
    }


def test_share_axes_fit_small_fractions_from_zero() -> None:
    """Clip fractions of at most 0.3% fill their panel instead of lying on a 0-1 axis's
    zero line; shares near 1 still start from 0 (a rise from 0.9955 is no trend)."""
    records = _several_updates_run()
    fig = dashboard._build_figure(records, "t")
    lines = _panel_lines(fig, "Clip fractions")
    high = lines["clipped high"]
    assert list(high.get_ydata()) == [r["actor/clip_frac_high"] for r in records]
    low, top = high.axes.get_ylim()
    assert low <= 0 < 0.003 < top < 0.01
    assert max(lines["clipped low"].get_ydata()) > 0.1 * top  # not flattened onto zero
    fig = dashboard._build_figure([{**r, "sampling/all_wrong_frac": 0.9955} for r in records], "t")
    assert _panel_lines(fig, "Dynamic sampling")["all-wrong groups"].axes.get_ylim()[0] <= 0


def _drawn_tick_labels(ax: Any) -> list[Any]:
    """The tick labels the axes draws (the locator also places ticks outside the view)."""
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    xs = [t for t in ax.get_xticklabels() if x0 <= t.get_position()[0] <= x1]
    ys = [t for t in ax.get_yticklabels() if y0 <= t.get_position()[1] <= y1]
    return [t for t in xs + ys if t.get_visible() and t.get_text()]


def test_no_axis_label_or_title_overlaps_a_tick_label() -> None:
    """Rendered, no axis label, title, legend (the panel titles) or ``1e-4`` offset
    overlaps a tick label, of its own panel or the next: a PPO KL of +-1e-4 had tick labels
    (-0.000125) wide enough to push the "ppo kl" label onto the throughput panel's ticks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = dashboard._build_figure(_several_updates_run(), "t")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ticks = [
        (t.get_text(), t.get_window_extent(renderer))
        for ax in fig.axes
        for t in _drawn_tick_labels(ax)
    ]
    assert len(ticks) > 100
    labels: list[Any] = []
    for ax in fig.axes:
        texts = [ax.xaxis.label, ax.yaxis.label, ax.title]
        texts += [ax.xaxis.get_offset_text(), ax.yaxis.get_offset_text()]
        labels += [t for t in texts if t.get_visible() and t.get_text()]
        if ax.get_legend():
            labels.append(ax.get_legend())
    names = [getattr(t, "get_text", lambda: "")() for t in labels]
    assert "ppo kl" in names and "tokens / s" in names
    overlaps = [
        (name, text)
        for label, name in zip(labels, names, strict=True)
        for text, box in ticks
        if label.get_window_extent(renderer).overlaps(box)
    ]
    assert not overlaps


def test_dynamic_sampling_panel_draws_the_carried_surplus() -> None:
    """The groups kept beyond a step's batch (sampling/carried_over) are a line of the
    dynamic-sampling panel."""
    records = _several_updates_run(8)
    lines = _panel_lines(dashboard._build_figure(records, "t"), "Dynamic sampling")
    xs, ys = lines["carried to next step"].get_data()
    assert list(xs) == list(range(1, 9))
    assert list(ys) == [r["sampling/carried_over"] for r in records]


def test_dynamic_sampling_panel_draws_a_discarded_surplus_only_when_there_is_one() -> None:
    """algorithm.keep_surplus=false: the surplus thrown away is a line of its own; a run that
    carries it (the counter always 0) draws no such line."""
    records = [{**r, "sampling/surplus_discarded": 0.0} for r in _several_updates_run(8)]
    carried = _panel_lines(dashboard._build_figure(records, "t"), "Dynamic sampling")
    assert "surplus discarded" not in carried
    discarded = [
        {**r, "sampling/carried_over": 0.0, "sampling/surplus_discarded": float(r["step"] % 3)}
        for r in records
    ]
    lines = _panel_lines(dashboard._build_figure(discarded, "t"), "Dynamic sampling")
    _, ys = lines["surplus discarded"].get_data()
    assert list(ys) == [r["sampling/surplus_discarded"] for r in discarded]

"""The GPU machine's commands on the CPU: ``make gpu-wheels`` (``scripts/gpu/wheelhouse.py``),
``make test-gpu`` and ``make bench-gpu`` (``scripts/gpu/run.py``): argument handling, the
wheelhouse plan, time budgets and the results folder's layout (what comes back from a GPU
machine: at most 8 files with plain names)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"
RETURNED_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what the GPU machine's $OUT brings back


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


wheelhouse = _load("wheelhouse")
run = _load("run")


def fake_wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A wheel file with only its METADATA (what the plan reads)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


# --- the wheelhouse --------------------------------------------------------------------------


def test_the_requirements_pin_what_the_gpu_image_lacks():
    required = wheelhouse.read_requirements()
    # The image (KINDS.md) has torch, transformers, peft, accelerate, pyarrow, safetensors,
    # tensorboard, pytest, hypothesis...; dapo's data, math scorer and the TRL benchmark need these.
    assert {
        "datasets",
        "math-verify",
        "latex2sympy2-extended",
        "antlr4-python3-runtime",
        "dill",
        "multiprocess",
        "trl",
    } <= set(required)
    assert not {"torch", "transformers", "pyarrow", "numpy"} & set(required)
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.]*", v) for v in required.values())


def test_a_requirement_without_a_pin_is_refused_with_its_line(tmp_path):
    path = tmp_path / "requirements.txt"
    path.write_text("# comment\ndatasets==5.2.0\ntrl>=1.0\n")
    with pytest.raises(
        ValueError, match=r"requirements.txt:3: 'trl>=1.0' is not of the form name==version"
    ):
        wheelhouse.read_requirements(path)


def test_the_plan_installs_only_what_the_machine_lacks_and_checks_their_needs(tmp_path):
    fake_wheel(
        tmp_path,
        "datasets",
        "5.2.0",
        "pyarrow>=24.0.0",
        "dill<0.4.2,>=0.3.0",
        "typing; python_version < '3.5'",
    )
    fake_wheel(tmp_path, "dill", "0.4.1")
    fake_wheel(tmp_path, "trl", "1.16.0", "transformers>=4.56.2")
    required = {"datasets": "5.2.0", "dill": "0.4.1", "trl": "1.16.0", "math-verify": "0.9.0"}
    installed = {"pyarrow": "21.0.0", "transformers": "5.17.0", "trl": "1.15.0"}
    p = wheelhouse.plan(tmp_path, required, installed)
    assert p.install == ["datasets-5.2.0-py3-none-any.whl", "dill-0.4.1-py3-none-any.whl"]
    assert p.present == {"trl": "1.15.0"}  # the machine's own is used, nothing shadowed
    assert p.missing == ["math-verify"] and not p.ok
    assert p.unmet == ["datasets: pyarrow 21.0.0 does not meet >=24.0.0"]  # the marker line is off
    assert p.problems()[0].startswith("math-verify is neither installed nor in the wheelhouse")
    assert p.wheel_bytes == sum(w.stat().st_size for w in tmp_path.glob("*.whl"))


def test_two_versions_of_one_package_are_named(tmp_path):
    fake_wheel(tmp_path, "dill", "0.4.0")
    fake_wheel(tmp_path, "dill", "0.4.1")
    p = wheelhouse.plan(tmp_path, {"dill": "0.4.1"}, {})
    assert p.duplicates == ["dill"] and not p.ok
    assert "dill is in the wheelhouse more than once: keep one version" in p.problems()
    assert wheelhouse.wheel_name(Path("Math_Verify-0.9.0-py3-none-any.whl")) == (
        "math-verify",
        "0.9.0",
    )


def test_fill_keeps_the_pinned_wheels_and_refuses_a_folder_over_the_limit(tmp_path, monkeypatch):
    gpu = tmp_path / ".gpu"
    (gpu / "wheels").mkdir(parents=True)
    fake_wheel(gpu / "wheels", "dill", "0.3.9")  # a stale version from an earlier pin

    def download(names: dict, dest: Path) -> None:
        for name, version in names.items():
            fake_wheel(dest, name, version)

    def copy_model(cache: Path) -> Path:
        (cache / "builtin-tiny-v3").mkdir(parents=True, exist_ok=True)
        (cache / "builtin-tiny-v3" / "model.safetensors").write_bytes(b"0" * 1000)
        return cache / "builtin-tiny-v3"

    monkeypatch.setattr(wheelhouse, "download", download)
    monkeypatch.setattr(wheelhouse, "copy_model", copy_model)
    monkeypatch.setattr(wheelhouse, "tree_bytes", lambda root=None: 4000)
    manifest = wheelhouse.fill(gpu, {"dill": "0.4.1", "trl": "1.16.0"})
    assert sorted(manifest["wheels"]) == [
        "dill-0.4.1-py3-none-any.whl",
        "trl-1.16.0-py3-none-any.whl",
    ]
    assert json.loads((gpu / "manifest.json").read_text()) == manifest
    assert manifest["gpu_dir_bytes"] > 1000 and manifest["tree_bytes"] == 4000
    monkeypatch.setattr(wheelhouse, "LIMIT_BYTES", 5000)
    with pytest.raises(SystemExit, match=r"MiB would travel, over the limit"):
        wheelhouse.fill(gpu, {"dill": "0.4.1"})


def test_check_prints_the_plan_and_fails_on_a_missing_package(tmp_path, capsys):
    req = tmp_path / "requirements.txt"
    req.write_text("pytest==1.0\nno-such-package-here==1.0\n")
    assert wheelhouse.main(["check", "--gpu-dir", str(tmp_path), "--requirements", str(req)]) == 1
    out = capsys.readouterr()
    plan = json.loads(out.out)
    assert "pytest" in plan["present"] and plan["missing"] == ["no-such-package-here"]
    assert "warning: no-such-package-here is neither installed nor in the wheelhouse" in out.err


# --- the commands' arguments and budgets --------------------------------------------------------


def test_arguments_of_the_two_commands(capsys):
    args = run.parse_args(["test", "--", "-k", "fsdp", "-x"])
    assert args.pytest_args == ["-k", "fsdp", "-x"] and args.budget_s == 540
    assert run.parse_args(["bench", "--quick", "--budget-s", "300"]).quick
    for argv, message in (
        (["bench", "--", "-k", "x"], "bench takes no pytest arguments"),
        (["test", "--budget-s", "30"], "--budget-s must be at least 60"),
        (["test", "--quick"], "--quick is for bench"),
        (["train"], "invalid choice: 'train'"),
    ):
        with pytest.raises(SystemExit) as info:
            run.parse_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_results_folder_is_out_then_the_out_variable_then_gpu_results(tmp_path):
    assert run.results_dir(tmp_path / "a", {"OUT": str(tmp_path / "b")}) == tmp_path / "a"
    assert run.results_dir(None, {"OUT": str(tmp_path / "b")}) == tmp_path / "b"
    assert run.results_dir(None, {}) == ROOT / "gpu-results"


@pytest.mark.slow
def test_a_command_past_its_budget_is_stopped_with_its_children(tmp_path):
    log = tmp_path / "x.log"
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"  # noqa: E501
    start = time.monotonic()
    result = run.run_bounded([sys.executable, "-c", child], dict(os.environ), log, timeout_s=3)
    assert result["timed_out"] and time.monotonic() - start < 20
    assert result["returncode"] != 0
    text = log.read_text()
    assert "started" in text and "[stopped after 3 s: the command's time budget]" in text


def test_test_phases_become_one_row_per_test():
    lines = [
        {"test": "t::a", "when": "call", "outcome": "passed", "seconds": 1.0, "message": ""},
        {
            "test": "t::b",
            "when": "setup",
            "outcome": "skipped",
            "seconds": 0.0,
            "message": "CUDA is not available",
        },
        {
            "test": "t::c",
            "when": "call",
            "outcome": "failed",
            "seconds": 2.0,
            "message": "assert 1 < 0",
        },
        {"test": "t::d", "when": "call", "outcome": "passed", "seconds": 3.0, "message": ""},
        {
            "test": "t::d",
            "when": "teardown",
            "outcome": "failed",
            "seconds": 0.5,
            "message": "boom",
        },
    ]
    rows = {r["test"]: r for r in run.collect_tests(lines)}
    assert [rows[t]["outcome"] for t in ("t::a", "t::b", "t::c", "t::d")] == [
        "passed",
        "skipped",
        "failed",
        "error",
    ]
    assert rows["t::b"]["message"] == "CUDA is not available" and rows["t::d"]["seconds"] == 3.5


@pytest.mark.slow
def test_the_report_plugin_writes_each_test_as_it_ends(tmp_path):
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent("""
        import pytest
        def test_pass(): pass
        def test_fail(): assert 1 + 1 == 3, "arithmetic"
        @pytest.mark.skip(reason="no GPU here")
        def test_skip(): pass
    """)
    )
    report = tmp_path / "report.jsonl"
    env = {**os.environ, "PYTHONPATH": str(GPU), run.REPORT_ENV: str(report)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "report_plugin",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_x.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
    )
    rows = {r["test"].split("::")[-1]: r for r in run.collect_tests(run.read_jsonl(report))}
    assert {k: r["outcome"] for k, r in rows.items()} == {
        "test_pass": "passed",
        "test_fail": "failed",
        "test_skip": "skipped",
    }
    assert (
        "arithmetic" in rows["test_fail"]["message"]
        and rows["test_skip"]["message"] == "no GPU here"
    )


# --- what comes back: the results folder -----------------------------------------------------


def returned(out: Path) -> list[str]:
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(RETURNED_NAME.match(f) for f in files), files
    return files


@pytest.mark.slow
def test_make_test_gpu_on_a_cpu_skips_every_test_and_reports_why(tmp_path):
    """The whole command on this CPU: no wheel to install (the venv has them), the tier
    collected and every test skipped with its reason, the three files written."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out)}
    proc = subprocess.run(
        [sys.executable, str(GPU / "run.py"), "test", "--gpu-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert returned(out) == ["test-gpu.json", "test-gpu.log", "test-gpu.md"]
    report = json.loads((out / "test-gpu.json").read_text())
    assert report["counts"]["skipped"] == len(report["tests"]) >= 12
    assert report["counts"]["passed"] == report["counts"]["failed"] == 0
    assert all(t["message"].startswith("CUDA is not available") for t in report["tests"])
    assert report["environment"]["cuda_available"] is False
    # Only a package this venv lacks (e.g. trl without the bench extra) could be a problem here.
    assert all("neither installed nor in the wheelhouse" in p for p in report["setup"]["problems"])
    md = (out / "test-gpu.md").read_text()
    assert md.startswith(
        f"# make test-gpu: 0 passed, 0 failed, 0 errors, {len(report['tests'])} skipped"
    )
    assert "| test_fsdp2_at_world_size_1_over_nccl_trains_checkpoints_and_resumes | skipped |" in md


MEMORY = {
    "settings": {
        "model": {"hidden": 896, "layers": 24, "vocab": 151936, "parameters": 494032768},
        "prompts": 32,
        "generations": 8,
        "max_completion_length": 256,
        "memory": "torch.cuda.max_memory_allocated",
    },
    "results": {
        "fp32": {"before_mb": 7600.0, "peak_mb": 30000.0, "step_s": 20.0},
        "trl": {"before_mb": 7900.0, "peak_mb": 17500.0, "step_s": 30.0},
    },
    "ckpt_over_trl": None,
}
ENGINES = {
    "settings": {
        "prompts": 16,
        "n": 8,
        "max_tokens": 64,
        "temperature": 1.0,
        "repeats": 3,
        "device": "cuda",
    },
    "results": [
        {
            "model": "tiny",
            "params_m": 0.8,
            "engine": "hf",
            "tokens_per_s": 9000.0,
            "tokens_per_s_best": 9500.0,
            "startup_s": 0.0,
        }
    ],
}


def test_make_bench_gpu_writes_both_tables_and_says_which_benchmark_gave_nothing(
    tmp_path, monkeypatch
):
    """The benchmarks replaced by stand-ins that write the real reports' fields (one of
    them fails): JSON, Markdown and log in the results folder."""

    def steps(python: str, work: Path, quick: bool) -> list:
        script = "import json, sys; open(sys.argv[1], 'w').write(sys.argv[2]); print('ran')"
        return [
            (
                "bench_memory",
                [python, "-c", script, str(work / "m.json"), json.dumps(MEMORY)],
                work / "m.json",
            ),
            ("bench_engines", [python, "-c", "import sys; sys.exit(3)"], work / "e.json"),
        ]

    monkeypatch.setattr(run, "bench_steps", steps)
    out = tmp_path / "out"
    assert run.main(["bench", "--gpu-dir", str(tmp_path), "--out", str(out)]) == 1
    assert returned(out) == ["bench-gpu.json", "bench-gpu.log", "bench-gpu.md"]
    report = json.loads((out / "bench-gpu.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["bench_memory", "bench_engines"]
    assert report["runs"][0]["report"] == MEMORY and report["runs"][1]["returncode"] == 3
    md = (out / "bench-gpu.md").read_text()
    assert md.startswith("# make bench-gpu: 1 of 2 benchmarks done")
    assert "| fp32 | 7600 | 30000 | 20.0 |" in md and "| trl | 7900 | 17500 | 30.0 |" in md
    assert "No result (exit 3" in md and "ran" in (out / "bench-gpu.log").read_text()
    assert "| tiny | 0.8 | hf | 9000.0 | 9500.0 | 0.0 |" in "\n".join(run.engines_markdown(ENGINES))


def test_the_benchmarks_are_the_issues_settings():
    (run_name, cmd_r, _), (engines, cmd_e, _), (memory, cmd_m, _) = run.bench_steps(
        "python3", Path("/w"), quick=False
    )
    assert (run_name, engines, memory) == ("default_run", "bench_engines", "bench_memory")
    assert cmd_r[1:4] == ["benchmarks/time_default_run.py", "--steps", "20"]
    assert cmd_m[1:8] == [
        "benchmarks/bench_memory.py",
        "--prompts",
        "32",
        "--generations",
        "8",
        "--max-completion-length",
        "256",
    ]
    assert "--sides" not in cmd_m  # all of them: fp32, bf16-mixed, bf16-mixed+ckpt and TRL
    assert cmd_e[1:6] == [
        "benchmarks/bench_engines.py",
        "--models",
        "tiny,100m",
        "--engines",
        "hf,generate",
    ]
    default = {"result": {"steps": 20, "median_step_s": 0.3, "median_gen_s": 0.2,
                          "median_train_s": 0.08, "run_s": 40.0, "precision": "bf16-mixed"}}  # fmt: skip
    assert "| 0.3 | 0.2 | 0.08 | 40.0 |" in "\n".join(run.default_run_markdown(default))


def test_the_source_commit_is_the_projects_own_or_no_git(tmp_path):
    """A copy of the tree inside another repository (as on the GPU machine, where git found
    an enclosing repository's commit) reports "no git"; a tree that is its own repository
    reports its commit."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    outer = tmp_path / "outer"
    (outer / "project").mkdir(parents=True)
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    assert run.own_commit(outer / "project") == "no git"
    assert run.own_commit(tmp_path) == "no git"  # no repository at all
    inner = tmp_path / "own"
    inner.mkdir()
    subprocess.run([*git, "init", "-q", str(inner)], check=True)
    subprocess.run([*git, "-C", str(inner), "commit", "-q", "--allow-empty", "-m", "y"], check=True)
    head = subprocess.run(
        ["git", "-C", str(inner), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert run.own_commit(inner) == head


def test_make_gpu_all_fits_one_device_command():
    """``make gpu-all`` runs the tier and then the benchmarks (even after a failed test) with
    budgets that add up to less than the 600 s a device command may take, and the
    benchmarks' guaranteed shares fit the benchmarks' budget."""
    rule = (ROOT / "Makefile").read_text().split("\ngpu-all:\n", 1)[1].split("\n\n", 1)[0]
    lines = [x.strip() for x in rule.splitlines()]
    assert lines[0].startswith("-$(GPU_PYTHON) scripts/gpu/run.py test")  # "-": go on after it
    assert "scripts/gpu/run.py bench" in lines[1]
    budgets = [float(re.search(r"--budget-s (\d+)", x).group(1)) for x in lines]
    assert sum(budgets) + 2 * run.KILL_GRACE_S <= 600
    assert sum(run.BENCH_MIN_S.values()) <= budgets[1]

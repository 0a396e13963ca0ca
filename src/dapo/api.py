"""The Python entry point, for notebooks and scripts: :func:`train`, :func:`make_trainer`,
:func:`make_config` (``dapo.train`` and so on).

The configuration is the CLI's: a YAML file, or the mapping such a file holds, then keyword
overrides as dotted keys (``**{"train.lr": 1e-6}``) or sections (``train={"lr": 1e-6}``),
validated by the same rules with the same messages (an unknown key says "did you mean").
Python objects stand in for config strings: data sets, reward callables, a loaded model and
tokenizer, an environment and tools; callbacks watch or stop the run
(:mod:`dapo.training.inputs`). Under ``torchrun`` the script is the entry point on every
rank: call these functions on every rank alike.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dapo.config import Config, ConfigError, all_keys, foreign, load_config, read_config_file
from dapo.errors import ModelError, NothingToTrain
from dapo.models import load_tokenizer
from dapo.parallel import distributed as D
from dapo.rewards.user import check_signature
from dapo.run_inputs import RunInputs
from dapo.training.inputs import check_callbacks
from dapo.training.trainer import Trainer

__all__ = ["make_config", "make_trainer", "train"]


ConfigSource = str | Path | Mapping[str, Any] | Config | None  # a YAML path, its mapping, a Config


def make_config(config: ConfigSource = None, **overrides: Any) -> Config:
    """The run's :class:`~dapo.config.Config`: defaults < preset < ``config`` < ``overrides``.

    ``config``: a YAML file's path, the mapping a YAML file holds, or a ``Config`` (whose
    preset is applied already: the overrides change its values, and cannot change its preset).
    A file or mapping may use dotted keys (``{"train.steps": 5}``) and sections alike; a key
    given twice (dotted and in its section) is an error naming both.
    ``overrides``: dotted keys (``**{"train.lr": 1e-6}``), sections (``train={"lr": 1e-6}``)
    and top-level keys (``preset="grpo"``, ``seed=1``). Raises :class:`ConfigError` with
    the messages ``dapo train`` gives for the same keys."""
    return load_config(_file_layer(config, overrides), overrides)


def make_trainer(
    config: ConfigSource = None,
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    reward_funcs: Any = None,
    callbacks: Any = None,
    model: Any = None,
    tokenizer: Any = None,
    processor: Any = None,
    environment: Any = None,
    tools: Any = None,
    agent: Any = None,
    **overrides: Any,
) -> Trainer:
    """A :class:`~dapo.training.trainer.Trainer` built as :func:`train` builds it, for
    step-by-step use: ``trainer.train_step()`` (one rollout step: its metrics and groups),
    ``trainer.evaluate()``, ``trainer.save()``, ``trainer.run()`` (the whole run, as
    :func:`train`); call ``trainer.close()`` when done without ``run()``. Callbacks are called
    by ``run()`` only. The arguments are :func:`train`'s."""
    _check_keywords(overrides)
    file_data = _file_layer(config, overrides)
    overrides = dict(overrides)
    # `model` is also a config section: a mapping is that section, a string its name_or_path.
    if isinstance(model, Mapping):
        overrides["model"], model = model, None
    elif isinstance(model, str | Path):
        overrides["model.name_or_path"], model = str(model), None
    if isinstance(tokenizer, str | Path):
        overrides["model.tokenizer"], tokenizer = str(tokenizer), None
    # config.yaml (and the resume check) say what was trained on: data.train names a file.
    for key, data in (("data.train", train_dataset), ("data.eval", eval_dataset)):
        if data is not None and not isinstance(data, str | Path):
            overrides[key] = _describe(key.removeprefix("data.") + "_dataset", data)
        elif data is not None:
            overrides[key] = str(data)
    if model is not None and not _given("model.name_or_path", file_data, overrides):
        # config.yaml and the resume check name the model that is trained.
        name = getattr(model, "name_or_path", "") or f"<{type(model).__name__} object>"
        overrides["model.name_or_path"] = name
    if isinstance(agent, str):
        overrides["rollout.agent"], agent = agent, None
    elif agent is not None:  # config.yaml records which function it was
        overrides["rollout.agent"] = f"<agent: {getattr(agent, '__qualname__', repr(agent))}>"
    objects = [
        key
        for key, value in (("rollout.environment", environment), ("rollout.tools", tools))
        if value is not None and value != []
    ]
    cfg = load_config(file_data, overrides, objects)
    if tokenizer is None and processor is not None:  # a processor holds its tokenizer
        tokenizer = getattr(processor, "tokenizer", None)
    inputs = RunInputs(
        model=model,
        tokenizer=_tokenizer(tokenizer, model, cfg),
        processor=processor,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        reward_funcs=_reward_funcs(reward_funcs, getattr(config, "reward_weights", None)),
        environment=environment,
        tools=_as_list(tools, "tools"),
        agent=agent,
        callbacks=_as_list(callbacks, "callbacks"),
    )
    check_callbacks(inputs.callbacks)
    return Trainer(cfg, inputs=inputs)


def train(
    config: ConfigSource = None,
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    reward_funcs: Any = None,
    callbacks: Any = None,
    model: Any = None,
    tokenizer: Any = None,
    processor: Any = None,
    environment: Any = None,
    tools: Any = None,
    agent: Any = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train a policy; the run's summary (what ``summary.json`` holds). With ``resume=True``
    and the run's checkpoint already at ``train.steps``, it says so in one line and returns the
    saved summary without loading anything (:class:`~dapo.errors.NothingToTrain`, which
    :func:`make_trainer` raises).

    - ``config`` and ``**overrides``: as :func:`make_config` (YAML path, mapping or Config;
      dotted keys, sections, ``preset=``). With no arguments: ``dapo train``'s default run.
    - ``train_dataset`` / ``eval_dataset``: a ``datasets.Dataset`` / ``DatasetDict``, a pandas
      DataFrame, a list of row dicts, or what ``data.train`` takes; they replace
      ``data.train`` / ``data.eval`` and go through the same column rules
      (``data.prompt_key``, ``data.answer_key``), dedup and length filter. Given a
      ``train_dataset`` and neither ``eval_dataset`` nor ``data.eval``, nothing is evaluated.
    - ``reward_funcs``: a callable or a list of callables, or ``(fn, weight)`` pairs;
      lambdas and closures too. Each is called in the form its parameters say: dapo's
      ``fn(response, ground_truth)`` (``data_source=`` too when it takes it), TRL's
      ``fn(completions, **kwargs) -> list`` once per group (``prompts``, ``completion_ids``,
      the dataset's other columns, ``trainer_state``; ``None`` = not applicable) or verl's
      ``compute_score(data_source, solution_str, ground_truth, extra_info)``; each returns
      a number or a dict with ``score`` (its other numbers are logged as
      ``reward/extra_*``). They are sent to the reward workers with cloudpickle (a
      time-out, exception or non-number costs the sample, ``reward/failures`` counts
      them), or run in this process when they cannot be pickled. They add to
      ``reward.functions``; what counts as correct: the data-and-rewards guide.
    - ``model`` / ``tokenizer``: a loaded transformers model and its tokenizer instead of
      ``model.name_or_path``; the model is trained in place (precision, LoRA, gradient
      checkpointing and device applied as to a loaded path). Without ``tokenizer`` the
      model's ``name_or_path`` (or ``model.tokenizer``) names it (or ``processor``'s).
    - ``processor``: a vision-language model's processor (``AutoProcessor.from_pretrained``),
      needed with a loaded image-text-to-text ``model``: it turns the images into the
      model's inputs (a model given by path loads its own).
    - ``environment`` / ``tools``: an environment class or factory and tool functions for
      multi-turn episodes, as ``rollout.environment`` / ``rollout.tools`` take them; they
      count as set for ``rollout.max_turns`` > 1 (``rollout={"max_turns": 3}``).
    - ``agent``: an agent function ``agent(client, record) -> reward | None`` (or ``async
      def``) driving each episode through an OpenAI client, as ``rollout.agent`` takes it.
    - ``callbacks``: functions ``fn(step, metrics)`` (a True return stops the run cleanly)
      or objects with ``on_step`` / ``on_evaluate`` / ``on_save`` (:mod:`dapo.training.inputs`).
    """
    created = not D.current().enabled  # a process group this call makes under torchrun
    try:
        trainer = make_trainer(
            config,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            reward_funcs=reward_funcs,
            callbacks=callbacks,
            model=model,
            tokenizer=tokenizer,
            processor=processor,
            environment=environment,
            tools=tools,
            agent=agent,
            **overrides,
        )
    except NothingToTrain as done:  # resume=True at train.steps: said, nothing loaded
        if created:
            D.destroy()
        return done.summary
    summary = trainer.run()
    # Released while every rank is still in the group, as `dapo train` releases its trainer:
    # freed after the group was destroyed (at this function's return), the run's distributed
    # objects hung rank 0 in native code there, once in CI, its peer gone.
    del trainer
    if created:
        D.destroy()  # every rank gets here; a failed run raises on its own
    return summary


# --- helpers ---------------------------------------------------------------------------


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a config object's repr runs to KBs)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _file_layer(config: Any, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """What ``config`` holds, as the mapping a YAML file would hold."""
    if config is None:
        return {}
    if isinstance(config, str | Path):
        return read_config_file(config)
    if isinstance(config, Config):
        preset = overrides.get("preset", config.preset)
        if preset != config.preset:  # its algorithm values are the old preset's already
            raise ConfigError(
                f"`preset` = {preset!r} cannot change a Config built with preset "
                f"{config.preset!r}; give the preset with a YAML path or a mapping of keys, or "
                "build the Config with it (dapo.make_config(preset=...))"
            )
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    if foreign.is_trl_config(config):  # a TRL GRPOConfig: the names its user set
        return foreign.trl_names(config)
    raise ConfigError(
        f"config = {_short(config)}: give a YAML file path, a mapping of keys (as "
        "the YAML file would hold), a dapo.config.Config or a TRL GRPOConfig"
    )


_KEYWORDS = (
    "config",
    "train_dataset",
    "eval_dataset",
    "reward_funcs",
    "callbacks",
    "model",
    "tokenizer",
    "processor",
    "environment",
    "tools",
)


def _check_keywords(overrides: Mapping[str, Any]) -> None:
    """A keyword that is no config key but close to one of :func:`train`'s keywords is a
    typo of that keyword (``train_datset=``): say so before a config key is suggested."""
    top = {k for k in all_keys() if "." not in k}
    for key in overrides:
        if "." in key or key in top:
            continue
        close = difflib.get_close_matches(key, _KEYWORDS, n=1, cutoff=0.75)
        if close:
            raise ConfigError(
                f"unknown keyword argument `{key}=`: did you mean `{close[0]}=`? (a keyword "
                "that is no argument of dapo.train is read as a config key; "
                "see `dapo train --help-config`)"
            )


def _given(key: str, *layers: Mapping[str, Any]) -> bool:
    """Whether a layer sets ``key`` (``data.eval``), dotted or in a section."""
    for layer in layers:
        if key in layer:
            return True
        node: Any = layer
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            return True
    return False


def _describe(name: str, data: Any) -> str:
    """``<train_dataset: Dataset of 40 rows>``: what config.yaml records for in-memory data."""
    rows = getattr(data, "num_rows", None)  # datasets; a DatasetDict's by split
    if isinstance(rows, dict):
        size = " (" + ", ".join(f"{k}: {v} rows" for k, v in rows.items()) + ")"
    elif isinstance(rows, int) or hasattr(data, "__len__"):
        size = f" of {rows if isinstance(rows, int) else len(data)} rows"
    else:  # an iterator
        size = ""
    return f"<{name}: {type(data).__name__}{size}>"


def _as_list(value: Any, name: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str | bytes | Mapping):
        raise ConfigError(f"{name} = {value!r}: give a list (or one function or object)")
    return [value]


def _reward_funcs(value: Any, weights: Any = None) -> list[Any]:
    """``reward_funcs`` as ``(function, weight)`` pairs, each checked before anything runs;
    ``weights``: a TRL config's ``reward_weights``, one per function."""
    if value is None:
        return []
    one = callable(value) or isinstance(value, str)
    items = [value] if one else _as_list(value, "reward_funcs")
    if weights is not None:
        if len(weights) != len(items) or any(isinstance(i, tuple) for i in items):
            raise ConfigError(
                f"reward_weights = {list(weights)} (the TRL config's) needs one weight per "
                f"reward function: {len(items)} given, without weights of their own"
            )
        items = [(fn, float(w)) for fn, w in zip(items, weights, strict=True)]
    out = []
    for i, item in enumerate(items):
        fn, weight = item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0)
        where = f"reward_funcs[{i}]"
        if isinstance(fn, str):  # a built-in scorer or module:function, as reward.functions
            out.append((fn, _weight(weight, where)))
            continue
        if not callable(fn):
            raise ConfigError(
                f"{where} = {item!r} is not a function; give fn(response, ground_truth) -> float "
                "(or a TRL or verl reward function), "
                "a (fn, weight) pair, or a module:function spec (one pair goes in a list: "
                "[(fn, 2.0)])"
            )
        check_signature(fn, where)
        out.append((fn, _weight(weight, where)))
    return out


def _weight(weight: Any, where: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ConfigError(f"{where}: the weight must be a finite number, got {weight!r}")
    return float(weight)


def _tokenizer(tokenizer: Any, model: Any, cfg: Config) -> Any:
    """The given tokenizer with a pad token, or the one the given model names; None: the
    trainer loads ``model.tokenizer`` / ``model.name_or_path``'s."""
    if tokenizer is None:
        if model is None:
            return None
        source = cfg.model.tokenizer or getattr(model, "name_or_path", "")
        if not source:
            raise ConfigError(
                f"model = a {type(model).__name__} without a name_or_path: give its tokenizer "
                "too (tokenizer=...), or set model.tokenizer to the tokenizer's directory"
            )
        return load_tokenizer(source, trust_remote_code=cfg.model.trust_remote_code)
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ModelError(
            f"tokenizer = {type(tokenizer).__name__} has no EOS token, so responses cannot end; "
            "set tokenizer.eos_token"
        )
    if tokenizer.pad_token_id is None:  # as load_tokenizer does for a path
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

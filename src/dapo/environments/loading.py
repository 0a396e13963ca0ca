"""Loading environments, tools and tool-call parsers from config strings or Python objects.

A spec is a built-in name (:data:`BUILTIN_ENVIRONMENTS`, :data:`~dapo.environments.tools.PARSERS`),
``package.module:Name``, ``path/to/file.py:Name``, or (from Python) the object itself: a
class, a function, also a lambda or closure defined in ``__main__``. Everything is loaded
here first, in the calling process, so that a bad spec is a :class:`~dapo.errors.ConfigError`
naming the key and the fix before anything runs. Worker processes load strings again by
name, and objects from a cloudpickle copy (:meth:`EnvironmentSpec.payload`).
"""

from __future__ import annotations

import difflib
import importlib
import pickle
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo.environments.base import ToolEnvironment
from dapo.environments.tools import PARSERS, ToolCall, tool_schema
from dapo.errors import ConfigError
from dapo.workers import NotPythonError, import_file

# Built-in environments, by name (rollout.environment).
BUILTIN_ENVIRONMENTS = {
    "calculator": "dapo.data.tasks.calculator:CalculatorEnvironment",
}

_SPEC_FORMS = "a built-in name, 'package.module:Name' or 'path/to/file.py:Name'"

Ref = tuple[str, Any]  # ("spec", "module:Name") or ("object", the object itself)


@dataclass
class EnvironmentSpec:
    """What every episode's environment is made of: the user's environment (``factory``,
    a class or a function returning an instance; ``None``: tools only), the tools and the
    tool-call parser. :meth:`make` builds one episode's environment."""

    name: str  # for messages: the spec, the class's name, or the tools' names
    factory: Callable[[], Any] | None
    tools: list[Callable[..., Any]]
    parser: Callable[[str], list[ToolCall]]
    schemas: list[dict[str, Any]]  # the tools' JSON schemas, for the chat template
    refs: tuple[Ref | None, list[Ref], Ref] = field(repr=False, default=(None, [], ("spec", "")))

    def make(self) -> Any:
        """One environment instance (wrapped in a :class:`ToolEnvironment` when there are tools)."""
        return make_environment(self.factory, self.tools, self.parser, self.name)

    def payload(self) -> bytes | None:
        """The spec as bytes a worker process can load, or ``None`` when some object cannot
        be sent (not picklable, or defined in ``__main__`` without cloudpickle)."""
        try:
            import cloudpickle as pickler
        except ImportError:  # plain pickle sends objects by reference only
            pickler = pickle
            objects = [
                r[1] for r in (self.refs[0], *self.refs[1], self.refs[2]) if r and r[0] == "object"
            ]
            if any(getattr(o, "__module__", None) == "__main__" for o in objects):
                return None
        try:
            return pickler.dumps(self.refs)
        except Exception:
            return None


def make_environment(
    factory: Callable[[], Any] | None,
    tools: Sequence[Callable[..., Any]],
    parser: Callable[[str], list[ToolCall]],
    name: str,
) -> Any:
    """One episode's environment from the loaded parts (see :class:`EnvironmentSpec`)."""
    env = None if factory is None else factory()
    if env is not None and not (
        callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))
    ):
        raise TypeError(
            f"{name}() returned {type(env).__name__}, which has no reset and step methods"
        )
    return ToolEnvironment(tools, parser, env) if tools else env


def load_environment(
    environment: Any = None,
    tools: Sequence[Any] = (),
    tool_parser: Any = "hermes",
) -> EnvironmentSpec | None:
    """Load ``rollout.environment``, ``rollout.tools`` and ``rollout.tool_parser``.

    Returns ``None`` when there is neither an environment nor a tool (single-turn runs).
    The environment's class attribute ``tools`` (see :class:`~dapo.environments.Environment`)
    adds to ``tools``. Raises :class:`~dapo.errors.ConfigError` for a spec that cannot be
    imported, an environment without ``reset``/``step``, a tool without a schema, two tools
    of one name, or an unknown parser.
    """
    if environment is None and not tools:
        return None
    factory, env_ref, name = None, None, ""
    if environment is not None:
        factory, env_ref, name = _load_environment(environment)
    keyed = [(t, f"{name}.tools") for t in getattr(factory, "tools", None) or ()]
    tool_refs = []  # the class's own tools come with the class
    if isinstance(tools, str):
        tools = [tools]
    for i, tool in enumerate(tools):
        fn, ref = _resolve(tool, f"rollout.tools[{i}]")
        keyed.append((fn, f"rollout.tools[{i}]"))
        tool_refs.append(ref)
    fns = [_check_tool(fn, key) for fn, key in keyed]
    names = [fn.__name__ for fn in fns]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"`rollout.tools`: more than one tool is named {', '.join(map(repr, twice))}; the "
            "model calls tools by name. Fix: give each tool function its own name."
        )
    schemas = [tool_schema(fn, key) for fn, key in keyed]
    parser, parser_ref = _parser_and_ref(tool_parser)
    if not name:
        name = f"tools ({', '.join(names)})"
    return EnvironmentSpec(name, factory, fns, parser, schemas, (env_ref, tool_refs, parser_ref))


def resolve_refs(refs: tuple[Ref | None, list[Ref], Ref]) -> tuple[Any, list[Any], Any]:
    """The objects behind a spec's refs (in a worker process: strings are imported again)."""
    env_ref, tool_refs, parser_ref = refs
    factory = None if env_ref is None else _from_ref(env_ref, "rollout.environment")
    fns = list(getattr(factory, "tools", None) or ())
    fns += [_from_ref(r, "rollout.tools") for r in tool_refs]
    return factory, fns, _from_ref(parser_ref, "rollout.tool_parser")


def _from_ref(ref: Ref, key: str) -> Any:
    kind, value = ref
    if kind == "object":
        return value
    if kind == "parser":
        return PARSERS[value]
    return import_spec(value, key)


def _load_environment(environment: Any) -> tuple[Callable[[], Any], Ref, str]:
    key = "rollout.environment"
    if isinstance(environment, str) and environment in BUILTIN_ENVIRONMENTS:
        spec = BUILTIN_ENVIRONMENTS[environment]
        return import_spec(spec, key), ("spec", spec), environment
    if isinstance(environment, str) and ":" not in environment:
        close = difflib.get_close_matches(environment, list(BUILTIN_ENVIRONMENTS), n=1)
        hint = f"did you mean {close[0]!r}? Or give " if close else "give "
        raise ConfigError(
            f"`{key}` = {environment!r} is neither a built-in environment "
            f"({', '.join(BUILTIN_ENVIRONMENTS)}) nor a 'module:Name' spec: {hint}"
            "'package.module:Name' or 'path/to/file.py:Name'"
        )
    obj, ref = _resolve(environment, key)
    name = environment if isinstance(environment, str) else getattr(obj, "__qualname__", repr(obj))
    if isinstance(obj, type):
        missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
        if missing:
            raise ConfigError(
                f"`{key}` = {name!r}: the class has no {' and no '.join(missing)} method. Fix: "
                "define reset(self, record) -> list of messages and step(self, assistant_text) "
                "-> (messages, reward or None, done), or subclass dapo.environments.Environment "
                "(its reset opens with the record's prompt)"
            )
    elif callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None)):
        raise ConfigError(
            f"`{key}` = {name!r} is an environment instance; give its class (one instance is "
            "made per episode) or a function that returns a new instance"
        )
    elif not callable(obj):
        raise ConfigError(
            f"`{key}` = {name!r} is a {type(obj).__name__}; give the environment's class (one "
            "instance is made per episode) or a function that returns a new instance"
        )
    return obj, ref, name


def _check_tool(fn: Any, key: str) -> Callable[..., Any]:
    if not callable(fn) or isinstance(fn, type) or not getattr(fn, "__name__", None):
        raise ConfigError(f"`{key}` = {fn!r} is not a function; a tool is a plain function")
    if fn.__name__ == "<lambda>":
        raise ConfigError(
            f"`{key}` is a lambda; a tool needs a name, type hints and a docstring (its JSON "
            "schema for the model). Fix: define it with def."
        )
    return fn


def load_parser(tool_parser: Any) -> Callable[[str], list[ToolCall]]:
    """``rollout.tool_parser``: a built-in format's name (:data:`PARSERS`), a
    'module:function' spec or a function; a :class:`ConfigError` naming the field otherwise."""
    return _parser_and_ref(tool_parser)[0]


def _parser_and_ref(tool_parser: Any) -> tuple[Callable[[str], list[ToolCall]], Ref]:
    key = "rollout.tool_parser"
    if isinstance(tool_parser, str) and tool_parser in PARSERS:
        return PARSERS[tool_parser], ("parser", tool_parser)
    if isinstance(tool_parser, str) and ":" not in tool_parser:
        raise ConfigError(
            f"`{key}` = {tool_parser!r} is not a known tool-call format "
            f"({', '.join(PARSERS)}); or give a parser function as 'package.module:function'"
        )
    fn, ref = _resolve(tool_parser, key)
    if not callable(fn):
        raise ConfigError(f"`{key}` = {tool_parser!r} is not a function")
    return fn, ref


def _resolve(value: Any, key: str) -> tuple[Any, Ref]:
    if isinstance(value, str):
        return import_spec(value, key), ("spec", _absolute(value))
    return value, ("object", value)


def _absolute(spec: str) -> str:
    """A file spec with its path made absolute (workers may have another working directory)."""
    module_part, _, attr = spec.rpartition(":")
    if _is_file(module_part):
        return f"{Path(module_part).expanduser().resolve()}:{attr}"
    return spec


def _is_file(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def import_spec(spec: str, key: str) -> Any:
    """The object named by ``package.module:Name`` or ``path/to/file.py:Name`` (dotted names
    reach attributes); :class:`~dapo.errors.ConfigError` naming ``key`` and the fix if not."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise ConfigError(f"`{key}` = {spec!r} is malformed: expected {_SPEC_FORMS}")
    try:
        module = (
            _import_file(module_part)
            if _is_file(module_part)
            else importlib.import_module(module_part)
        )
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"`{key}` = {spec!r}: module {module_part!r} not found ({exc}). Fix: check the "
            "spelling, install the package or add its directory to PYTHONPATH, or give a file "
            "path 'path/to/file.py:Name'"
        ) from exc
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"`{key}` = {spec!r}: importing {module_part!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in vars(module) if not n.startswith("_"))[:10]
            raise ConfigError(
                f"`{key}` = {spec!r}: {module_part!r} has no attribute {attr!r}; it defines "
                f"{', '.join(public) or 'nothing public'}"
            )
        obj = getattr(obj, part)
    return obj


def _import_file(path_text: str) -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ModuleNotFoundError(f"no file {str(path)!r}")
    try:
        return import_file(path, "_dapo_env_")
    except NotPythonError as exc:  # import_spec says "not found" for it, as for a missing file
        raise ModuleNotFoundError(str(exc)) from exc

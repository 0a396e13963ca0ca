"""Multi-turn environments and tools.

- :mod:`~dapo.environments.base`: the contract (``reset(record)``, ``step(assistant_text)``),
  the optional base class :class:`Environment`, the tool layer :class:`ToolEnvironment`.
- :mod:`~dapo.environments.tools`: tool schemas and tool-call parsers (``hermes``).
- :mod:`~dapo.environments.loading`: specs (``module:Class``, built-in names, objects).
- :mod:`~dapo.environments.pool`: :class:`EnvironmentPool`, instances in worker processes.
- :mod:`~dapo.environments.rendering`: :class:`ChatRenderer`, token-in/token-out rendering.

The episode loop over a rollout engine is :func:`dapo.rollout.episodes.run_episodes`.
"""

from dapo.environments.base import (
    Environment,
    EnvironmentWarning,
    Message,
    ToolEnvironment,
    prompt_messages,
)
from dapo.environments.loading import (
    BUILTIN_ENVIRONMENTS,
    EnvironmentSpec,
    load_environment,
    load_parser,
)
from dapo.environments.pool import EnvironmentPool, Outcome
from dapo.environments.rendering import ChatRenderer, RenderError, no_template_error
from dapo.environments.tools import PARSERS, ToolCall, ToolCallParseError, parse_hermes

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "PARSERS",
    "ChatRenderer",
    "Environment",
    "EnvironmentPool",
    "EnvironmentSpec",
    "EnvironmentWarning",
    "Message",
    "Outcome",
    "RenderError",
    "ToolCall",
    "ToolCallParseError",
    "ToolEnvironment",
    "load_environment",
    "load_parser",
    "no_template_error",
    "parse_hermes",
    "prompt_messages",
]

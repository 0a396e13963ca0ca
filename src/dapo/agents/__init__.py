"""Agents written for the OpenAI API as the environment of a training run.

- :mod:`~dapo.agents.endpoint`: the OpenAI-compatible HTTP endpoint (per-episode base URLs).
- :mod:`~dapo.agents.protocol`: the chat-completions wire format, and what a run refuses.
- :mod:`~dapo.agents.tracker`: token-exact trajectories (segments) from requests.
- :mod:`~dapo.agents.runners`: sync agents in worker processes, async ones on an event loop.
- :mod:`~dapo.agents.episodes`: :class:`AgentHost` and :func:`run_agent_episodes`.

The contract: ``agent(client, record) -> reward | None`` (or ``async def``), ``client``
an ``openai.OpenAI`` (``openai.AsyncOpenAI``) for the episode, ``record`` the prompt record
as a dict; ``None`` leaves the last assistant message to the reward functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapo.agents.episodes import AgentHost, run_agent_episodes
    from dapo.agents.runners import load_agent_spec

__all__ = ["AgentHost", "load_agent_spec", "run_agent_episodes"]


def __getattr__(name: str) -> Any:
    """The names above, imported on first use: an agent's worker process imports
    :mod:`dapo.agents.worker` only, not torch and transformers (6.9 s of every worker's
    start on a 2-core CPU)."""
    if name in ("AgentHost", "run_agent_episodes"):
        from dapo.agents import episodes

        return getattr(episodes, name)
    if name == "load_agent_spec":
        from dapo.agents.runners import load_agent_spec

        return load_agent_spec
    raise AttributeError(f"module 'dapo.agents' has no attribute {name!r}")

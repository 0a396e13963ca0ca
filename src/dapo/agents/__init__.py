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

from dapo.agents.episodes import AgentHost, run_agent_episodes
from dapo.agents.runners import load_agent_spec

__all__ = ["AgentHost", "load_agent_spec", "run_agent_episodes"]

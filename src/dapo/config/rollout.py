"""The ``rollout`` section: how responses (and multi-turn episodes) are sampled.

Bounds are on the fields; the rules between them are in :mod:`dapo.config.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo.choices import CudaGraphs, Engine, VLLMQuantization
from dapo.config.fields import opt


@dataclass
class RolloutConfig:
    """Sampling of responses (names as in TRL where the meaning is the same)."""

    engine: Engine = opt(
        "hf",
        "Generation backend: hf (dapo's sampling loop on the transformers policy itself), vllm "
        "(the vllm extra: an engine in the training process, one per rank under torchrun, that "
        "receives the policy's weights, see rollout.vllm_sync_every) or vllm-server (a `dapo "
        "vllm-serve` process at rollout.server_url, on its own GPUs; weights pushed to it from "
        "rank 0 over a process group).",
    )
    server_url: str | None = opt(
        None,
        "engine=vllm-server: the rollout server's address, http://HOST:PORT (what `dapo "
        "vllm-serve` prints). Every rank sends its prompts there; the server must reach the "
        "trainer's rank 0 back for the weight pushes.",
    )
    server_timeout_s: float = opt(
        600.0,
        "engine=vllm-server: seconds to wait for the server to come up, and for each of its "
        "answers (a whole generation call), before stopping with an error that names it.",
        gt=0,
        hint="seconds",
    )
    server_api_key: str | None = opt(
        None,
        "engine=vllm-server: the API key the server was started with (`dapo vllm-serve "
        "--api-key`), sent as `Authorization: Bearer KEY`; null: the DAPO_SERVER_API_KEY "
        "environment variable, else none. Never written out: config.yaml, checkpoints and "
        "logs hold null (give it again, or use the environment variable, when resuming).",
        secret=True,
    )
    max_staleness: int = opt(
        0,
        "Streaming rollouts: a producer generates the coming steps' batches while the trainer "
        "trains, at most N rollout steps ahead, so that no trained token was sampled more than "
        "N policy versions before the weights being updated (queued time counted). 0: "
        "synchronous (generate, then train). 1 is what rollout.async_steps=1 was. With N > 0 "
        "the ratio is taken against the proximal policy and algorithm.is_cap (default 5, mask) "
        "corrects the gap to the policy that sampled each token (AReaL's decoupled PPO); the "
        "hf engine then samples from a copy of the policy.",
        ge=0,
        le=64,
        hint="0: synchronous; 1-8 at scale (prime-rl's default is 8)",
    )
    partial_rollouts: bool = opt(
        False,
        "With rollout.max_staleness > 0: responses still being generated at a weight update "
        "continue under the new weights from the tokens they have (each token keeps the "
        "version and log-prob of the policy that sampled it), instead of finishing under the "
        "old ones. Generation then runs rollout.partial_chunk_tokens at a time.",
    )
    partial_chunk_tokens: int = opt(
        32,
        "rollout.partial_rollouts: tokens generated per engine call; a weight update waits at "
        "most one chunk, and each chunk after an update starts with a fresh prefill under the "
        "new weights (no cached key or value of older weights is used).",
        ge=1,
    )
    num_generations: int = opt(
        8,
        "G, the responses sampled per prompt (the group whose rewards are normalised "
        "together in GRPO and DAPO); at least 2. The DAPO paper uses 16.",
        ge=2,
        hint="group-relative advantages need at least 2 responses per prompt",
        paper="16",
    )
    temperature: float = opt(
        1.0,
        "Sampling temperature of the training rollouts; the loss's log-probs use the same "
        "temperature. The DAPO paper uses 1.0.",
        gt=0,
        hint="1.0 in the paper",
        paper="1.0",
    )
    top_p: float = opt(
        1.0,
        "Nucleus sampling of the training rollouts, in (0, 1]; 1.0 disables it (the DAPO "
        "paper's value).",
        gt=0,
        le=1,
        paper="1.0",
    )
    top_k: int = opt(
        0, "Sample only from the k most likely tokens; 0 disables it.", ge=0, hint="0: disabled"
    )
    max_completion_length: int = opt(
        64,
        "L_max, the cap on a response in tokens (TRL: max_completion_length); a response "
        "without an end-of-sequence token by then is truncated. The DAPO paper uses 20480 "
        "(16384 expected tokens + the 4096-token overlong buffer). A multi-turn episode's "
        "budget: model and environment tokens after the prompt together.",
        ge=1,
        paper="20480",
    )
    environment: str | None = opt(
        None,
        "Multi-turn episodes: an environment class as module:Class (or path/file.py:Class), "
        "or a built-in one (calculator). One instance per episode, in a worker process: "
        "reset(record) -> opening messages, step(assistant_text) -> (messages, reward | None, "
        "done). null with rollout.tools: a tools-only environment. null and no tools: one "
        "response per prompt.",
    )
    tools: list[str] = opt(
        help="Tools the model may call, as module:function (schema from the signature and "
        "docstring, passed to the chat template's tools=); a turn with a tool call gets the "
        "tools' results as the environment's reply.",
        factory=list,
    )
    tool_parser: str = opt(
        "hermes",
        'How tool calls are read from a model turn: hermes (<tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call>, the format of Qwen, Hermes and SmolLM2 templates) '
        "or module:function returning the calls of a text.",
        nonempty=True,
    )
    agent: str | None = opt(
        None,
        "An agent program as the environment: module:function (or path/file.py:function), "
        "agent(client, record) -> reward | None, sync or async def, called once per episode "
        "with an openai.OpenAI (AsyncOpenAI) client pointed at this run's OpenAI-compatible "
        "endpoint; None scores the last assistant message with the reward functions. "
        "rollout.max_turns bounds its requests, max_completion_length its tokens. Excludes "
        "rollout.environment and rollout.tools.",
    )
    agent_timeout_s: float = opt(
        300.0,
        "Seconds an agent's episode may take; past it the episode fails (env_failure) and "
        "its requests are refused.",
        gt=0,
    )
    max_turns: int = opt(
        1,
        "Model turns per episode at most; an episode still running after them is truncated "
        "(overlong filtering and the soft punishment apply to it). 1 with no environment: "
        "one response per prompt.",
        ge=1,
    )
    env_timeout_s: float = opt(
        30.0,
        "Seconds an environment's reset or step may take; past it the episode fails (counted "
        "in env/failures) and its worker is replaced.",
        gt=0,
    )
    env_workers: int = opt(
        1,
        "Worker processes hosting the environments or sync agents (time-outs, crash "
        "isolation); 0 runs them in the training process (environments without time-outs).",
        ge=0,
    )
    generation_batch_size: int = opt(
        256,
        "Sequences (prompts x responses) generated together; bounds the generation memory, "
        "not the training batch. The hf engine decodes on fewer where their key/value cache "
        "would take over 80% of the device's available memory, and says so once.",
        ge=1,
    )
    cuda_graphs: CudaGraphs = opt(
        "auto",
        "The hf engine on CUDA: replay its decode step (forward and sampling) from CUDA "
        "graphs, one captured per batch-size bucket and cache window. auto and on: on CUDA "
        "(a model that cannot be captured, or an FSDP-sharded policy, falls back with one "
        "line saying why; on also says so on a CPU); off: plain kernel launches.",
    )
    eval_temperature: float = opt(
        1.0,
        "Sampling temperature of the held-out evaluation; 0 is greedy. The DAPO paper "
        "evaluates at 1.0.",
        ge=0,
        hint="0: greedy",
        paper="1.0",
    )
    eval_top_p: float = opt(
        0.7,
        "Nucleus sampling of the held-out evaluation, in (0, 1]: the DAPO paper's 0.7 (as "
        "`dapo eval`), whatever the preset, so that every rung of a ladder is measured alike.",
        gt=0,
        le=1,
        paper="0.7",
    )
    eval_num_generations: int | None = opt(
        None,
        "Responses per held-out problem; the reported accuracy is avg@k over them (the DAPO "
        "paper reports avg@32 on AIME 2024). null: as `dapo eval`, the number of times the "
        "data repeats each problem (32 for the DAPO AIME file, 30 problems x 32 rows), else 1.",
        ge=1,
        hint="e.g. 32; null: the data's repeat count",
        paper="32",
    )
    vllm_sync_every: int = opt(
        1,
        "engine=vllm: push the policy's weights to vLLM every k optimizer updates; 1 keeps "
        "it current, a larger k samples from a slightly older policy.",
        ge=1,
        hint="1: every optimizer update",
    )
    vllm_gpu_memory_utilization: float = opt(
        0.3,
        "engine=vllm on a GPU: the share of the GPU's memory vLLM may take (weights and KV "
        "cache), in (0, 1]; the trainer needs the rest.",
        gt=0,
        le=1,
        hint="e.g. 0.3",
    )
    vllm_sleep: bool = opt(
        True,
        "engine=vllm on a GPU: release vLLM's memory while the trainer trains and take it "
        "back to generate.",
    )
    vllm_quantization: VLLMQuantization = opt(
        "none",
        "engine=vllm on a GPU: fp8 makes vLLM sample with FP8 weights (its quantization=fp8, "
        "at every push), a rounded policy: set algorithm.is_cap to correct it, watch "
        "rollout/mismatch_kl. vllm-server: `dapo vllm-serve MODEL --quantization fp8`.",
    )

"""``dapo vllm-serve MODEL``: a vLLM rollout server that trainers push their weights to."""

from __future__ import annotations

import argparse
import os

from dapo.choices import VLLM_QUANTIZATIONS

_SERVE_DESCRIPTION = """\
Serve MODEL with vLLM for trainers started with rollout.engine=vllm-server
rollout.server_url=http://HOST:PORT. The trainer sends its prompts over HTTP and pushes
its weights after every update over a process group of their own (NCCL on GPUs, gloo on
CPU), so the server must reach the trainer's rank 0 back. Run it on its own GPUs; Ctrl-C
(or SIGTERM) stops it within seconds.

It listens on 127.0.0.1 unless --host says otherwise. On a network, give it an API key
(--api-key, or better the DAPO_SERVER_API_KEY environment variable, which `ps` does not
show) and the trainer the same key (rollout.server_api_key or DAPO_SERVER_API_KEY): every
endpoint but /health then needs it. The weight channel itself (a process group on a port
the trainer opens) has no key: keep trainer and server on a network of their own.

Bad requests get a 400 naming the field and the limit. If the engine fails, or one job
runs longer than --job-timeout-s, the server answers 503 with the reason for 5 s and
exits with status 1, for a supervisor to restart it.
"""


def vllm_serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo vllm-serve",
        description=_SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model", help="the model the trainer trains: a directory, hub id or builtin:tiny"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)",
    )
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs the model is split over (default 1)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of each GPU vLLM may take (default 0.9: the GPUs are the server's own)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + response in tokens (default: the model's context)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences generated together"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every endpoint but /health (default: the "
        "DAPO_SERVER_API_KEY environment variable; none if unset)",
    )
    parser.add_argument(
        "--max-n", type=int, default=256, help="most responses per prompt (default 256)"
    )
    parser.add_argument(
        "--max-request-mb", type=float, default=64, help="largest request body in MiB (default 64)"
    )
    parser.add_argument(
        "--job-timeout-s",
        type=float,
        default=1800,
        help="a generation or weight load running longer is taken as a stuck engine: the server "
        "turns unhealthy and exits (default 1800)",
    )
    parser.add_argument(
        "--quantization",
        choices=[q for q in VLLM_QUANTIZATIONS if q != "none"],
        default=None,
        help="vLLM's weight quantization (fp8: FP8 weights on a GPU, quantized at every push; "
        "the trainer should set algorithm.is_cap)",
    )
    args = parser.parse_args(argv)
    if args.tensor_parallel_size < 1 or not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--tensor-parallel-size must be >= 1 and --gpu-memory-utilization in (0, 1]")
    if args.max_n < 1 or not args.max_request_mb > 0 or not args.job_timeout_s > 0:
        parser.error("--max-n must be >= 1, --max-request-mb and --job-timeout-s > 0")
    from dapo.rollout.protocol import API_KEY_ENV
    from dapo.rollout.server import serve

    serve(  # ends the process
        args.model,
        host=args.host,
        port=args.port,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_n=args.max_n,
        max_request_mb=args.max_request_mb,
        job_timeout_s=args.job_timeout_s,
        quantization=args.quantization,
    )
    return 0

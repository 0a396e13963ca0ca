"""``python tests/serve_with_faults.py vllm-serve ...``: ``dapo vllm-serve`` with faults put
inside its engine, for ``tests/test_rollout_server_vllm.py``. ``DAPO_TEST_FAULTS`` lists them:

- ``hang``: a generation with seed :data:`HANG_SEED` blocks the engine thread for ever.
- ``no-vocab-check``: token ids are not checked against the vocabulary, so an
  out-of-vocabulary id reaches vLLM and fails inside its forward pass (``IndexError: index out of
  range in self``, as users met it).
"""

from __future__ import annotations

import os
import sys
import threading

HANG_SEED = 424242


def main() -> int:
    faults = set(os.environ.get("DAPO_TEST_FAULTS", "").split(","))
    from dapo.rollout import protocol, vllm_engine

    if "hang" in faults:
        real = vllm_engine.VLLMEngine.generate_many

        def generate_many(self, calls):
            if any(params.seed == HANG_SEED for _, params in calls):
                threading.Event().wait()  # stuck, as an engine in a dead loop is
            return real(self, calls)

        vllm_engine.VLLMEngine.generate_many = generate_many
    if "no-vocab-check" in faults:
        limits = protocol.Limits
        protocol.Limits = lambda max_model_len, vocab_size, **kw: limits(max_model_len, 2**31, **kw)
    from dapo.rollout import server  # it took Limits by name: give it the patched one

    server.Limits = protocol.Limits
    from dapo.cli import main as dapo_main

    return dapo_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

"""Training: the rollout-step loop and its stages.

- ``trainer``: :class:`Trainer`, which composes the stages: sample, score, filter,
  advantages, update, log, save.
- ``dynamic_sampling``: fill the batch with groups that carry a learning signal.
- ``batch``: :class:`Sample`, one response with its advantage and loss mask.
- ``forward``: micro-batches and the log-prob forward passes.
- ``step``: one optimizer step with exact loss normalisation.
- ``checkpoint``: atomic checkpoints.
"""

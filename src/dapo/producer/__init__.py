"""The rollout producer: everything that turns prompts into scored groups to train on.

- :mod:`~dapo.producer.rollouts`: :class:`Rollouts`, a rollout step's batch (sample, score,
  filter), owning the prompts, the engine (versioned), the environments or agents, the
  scorer, the dynamic sampler and the weight sync;
- :mod:`~dapo.producer.stream`: the producer thread of streaming rollouts
  (``rollout.max_staleness``);
- :mod:`~dapo.producer.scoring`, :mod:`~dapo.producer.dynamic_sampling`,
  :mod:`~dapo.producer.prompt_selection` (with :mod:`~dapo.producer.prompt_history`),
  :mod:`~dapo.producer.engine_sync`, :mod:`~dapo.producer.metrics`.

It meets the learner (:mod:`dapo.training`) in one hand-over, :mod:`dapo.handover`, and
imports nothing of it: the trainer composes the two.
"""

"""Training of the embedded default (issue 12): corpus, tokenizer, target and DSpark drafter.

Modules, one concern each:

* :mod:`~minimax_jax.training.corpus`: the standard-library corpus, its deterministic train / held-out split,
  pre-tokenised arrays on disk, training windows and held-out evaluation windows, the held-out prompts.
* :mod:`~minimax_jax.training.bpe`: training the byte-level BPE tokenizer.
* :mod:`~minimax_jax.training.presets`: the default and smoke configurations, parameter counts, size budgets.
* :mod:`~minimax_jax.training.loop`: optimiser and schedule, resumable orbax checkpoints, time budget, progress,
  metrics log and loss plot (shared by both training scripts).
* :mod:`~minimax_jax.training.target`: the target's training forward (indexer distillation, router load),
  loss, aux-loss-free router balancing and held-out bits per byte.
* :mod:`~minimax_jax.training.dspark`: the DSpark drafter's many-anchor training forward and DeepSpec loss.
* :mod:`~spec_decode.rollout`: cache-free speculative decoding rollouts (acceptance, STS records).

Training needs ``optax``, ``tqdm`` and ``matplotlib`` (the ``train`` / ``test`` extras); inference does not.
"""

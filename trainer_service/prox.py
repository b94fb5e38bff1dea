"""When the proximal log-probs need no pass of their own.

The decoupled objective scores each token by pi_theta / pi_prox, with pi_prox the
weights at the start of the step. With one optimizer update per step
(`algo.ppo_minibatches` 1) the loss pass runs on exactly those weights, so its own
log-probs, detached, are pi_prox: a separate no-grad forward would compute the same
numbers again (about a quarter of the step's compute). They are needed
before the loss pass, and so get their own pass, when:

- the step has several minibatches: the later ones run on updated weights;
- a critic values the batch (GAE), or the KL penalty goes into the reward: both are
  computed from pi_prox before the advantages, which the loss pass needs.
"""

from __future__ import annotations

from areal_hex.config.algo import AlgoConfig


def prox_from_loss_pass(algo: AlgoConfig, has_critic: bool) -> bool:
    """Whether the loss pass's own detached log-probs serve as the proximal ones."""
    kl_in_reward = algo.kl_coef > 0 and algo.kl_in_reward
    return algo.ppo_minibatches == 1 and not has_critic and not kl_in_reward

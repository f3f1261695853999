"""Mixture-of-experts: how many distinct experts a batch touches, and where they live."""

from __future__ import annotations

import jax.numpy as jnp

from .architecture import Model


def expected_experts_touched(tokens, num_experts: int, experts_per_token: int):
    """Expected number of distinct experts hit by `tokens` tokens routing top-k of E.

    With uniform, independent routing each expert is missed by one token with probability
    1 - k/E, so E[touched] = E (1 - (1 - k/E)^T). It is k at T = 1 and tends to E; it is
    smooth in T (a float), so gradients flow through batch size.

    Args:
        tokens: tokens in the step (float, >= 0).
        num_experts: E (static).
        experts_per_token: k (static).

    Returns:
        Expected distinct experts (float, same shape as `tokens`).

    Example:
        >>> round(float(expected_experts_touched(1.0, 256, 8)), 9)
        8.0
        >>> round(float(expected_experts_touched(4096.0, 256, 8)), 3)
        256.0
    """
    tokens = jnp.maximum(jnp.asarray(tokens, dtype=float), 0.0)
    miss = jnp.log1p(-experts_per_token / num_experts)
    # 1 - exp rather than -expm1: the same to about 1e-15 relative from one token up
    # (tokens x miss <= -k / E), and XLA:CPU's float64 expm1 made each step's call of it
    # about 0.2 ms of a 100,000-configuration vmap (`benchmarks/profile_vmap.py --trace`).
    return num_experts * (1.0 - jnp.exp(tokens * miss))


def ranks_per_token(num_experts: int, experts_per_token: int, ep):
    """Expected number of distinct expert-parallel ranks one token's top-k experts live on.

    With the E experts split evenly over `ep` ranks (E / ep each) and a token routing to k
    distinct experts drawn uniformly, a given rank holds none of them with the
    hypergeometric probability C(E - E/ep, k) / C(E, k) = prod_i (E - E/ep - i) / (E - i),
    i < k, so E[ranks] = ep (1 - that). It is 1 at ep = 1, at most min(k, ep), and
    continuous in `ep` (a float, so a traced `LayoutNumbers.ep` is fine).

    A dispatch that sends each token once to every rank holding any of its experts (DeepEP's
    normal kernels, TensorRT-LLM's all-to-all above ep = k) moves this many copies of the
    token, not k (`design.Runtime.dispatch_per_rank`).

    Args:
        num_experts: E (static).
        experts_per_token: k (static).
        ep: expert-parallel ranks (float, >= 1).

    Example:
        >>> round(float(ranks_per_token(256, 8, 1.0)), 9)
        1.0
        >>> round(float(ranks_per_token(256, 8, 8.0)), 3)   # DeepSeek-R1 over 8 ranks
        5.295
    """
    ep = jnp.maximum(jnp.asarray(ep, dtype=float), 1.0)
    others = num_experts - num_experts / ep
    miss = jnp.ones_like(ep)
    for i in range(experts_per_token):   # k is static and small (4 to 16)
        miss = miss * jnp.maximum(others - i, 0.0) / (num_experts - i)
    return ep * (1.0 - miss)


def expert_load(model: Model, tokens, ep: int):
    """Per-chip expert work of one MoE layer with experts spread over `ep` chips.

    Returns:
        (experts touched on one chip, token-expert assignments per chip, rows per touched
        expert): the first decides expert weight bytes read, the second FLOPs, the third the
        matmul shape (small rows reach a small fraction of peak).
    """
    E, k = model.num_experts, model.experts_per_token
    touched = expected_experts_touched(tokens, E, k)
    assignments = jnp.asarray(tokens, dtype=float) * k
    rows = assignments / jnp.maximum(touched, 1e-9)
    return touched / ep, assignments / ep, rows

"""Checks of the simulator's arguments: their kinds and layout before tracing
(`_validate`), the policy's traced values at run time (`_checked`)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from ..architecture import Model
from ..checks import arguments
from ..design import Design, Disaggregated, Layout
from ..hardware import Chip
from ..serving import check_layout
from .arrivals import Requests
from .engines import Policy


def _validate(model, chip, design, policy, requests):
    arguments(model=(model, Model), chip=(chip, Chip), design=(design, Design),
              policy=(policy, Policy), requests=(requests, Requests))
    if isinstance(design.layout, Disaggregated):
        raise ValueError("design.layout: `simulate` runs aggregated instances; simulate "
                         "a Disaggregated layout with `simulate_disaggregated`")
    if isinstance(design.layout, Layout):
        check_layout(model, design.layout)
        replicas = design.layout.replicas
        if requests.clients and requests.clients % replicas:
            raise ValueError(f"requests.clients ({requests.clients}) must be a multiple of "
                             f"design.layout.replicas ({replicas}): each replica serves "
                             "whole clients")


#: Run-time checks of traced policy values (a vmapped stack is checked here, not when built).
_POLICY_CHECKS = (
    ("max_num_seqs", lambda x: x >= 1, "policy.max_num_seqs must be >= 1"),
    ("max_num_batched_tokens", lambda x: x >= 1, "policy.max_num_batched_tokens must be >= 1"),
    ("long_prefill_token_threshold", lambda x: x >= 1,
     "policy.long_prefill_token_threshold must be >= 1 (inf for no cap)"),
    ("kv_blocks", lambda x: x >= 2, "policy.kv_blocks must be >= 2 (inf: from memory)"),
    ("block_size", lambda x: x >= 1, "policy.block_size must be >= 1"),
    ("output_reserve", lambda x: (x >= 0) & (x <= 1), "policy.output_reserve must be in [0, 1]"),
    ("batch_wait", lambda x: x >= 0, "policy.batch_wait must be >= 0"),
    ("batch_wait_tokens", lambda x: x >= 0, "policy.batch_wait_tokens must be >= 0"),
)


def _checked(policy: Policy) -> Policy:
    for name, test, message in _POLICY_CHECKS:
        value = getattr(policy, name)
        value = eqx.error_if(value, ~test(value) | jnp.isnan(value), message)
        policy = eqx.tree_at(lambda p, n=name: getattr(p, n), policy, value)
    return policy


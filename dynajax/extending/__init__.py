"""Extending dynajax: JAX rules for users' own ops (``rules``).

@dynajax.register_rule("mylib::soft_clip")
def _soft_clip(x, limit):
    return limit * jnp.tanh(x / limit)
"""

from __future__ import annotations

from dynajax.extending.rules import register_rule, resolve_ops, unregister_rule
from dynajax.lowering.registry import RuleOverrideWarning

__all__ = ["RuleOverrideWarning", "register_rule", "resolve_ops", "unregister_rule"]

"""Conformance checks for policies written in Python: the Rust traits'
own suites, run on the Python object."""

from ._native import check_eviction_policy as _check
from ._native import check_tier_policy as _check_tier
from .engine import _instance


def check_eviction_policy(policy, block_size: int = 16) -> None:
    """Runs ``kvforge_evict::testing::check_policy`` — the suite every Rust
    eviction policy passes — on ``policy``: tables of every kind of entry
    (hot, cold, shared, dropped, a sealed partial and an open last entry)
    and length, under low and high pressure, attention mass fed first when
    the policy wants it. Each answer must ascend, exist, name live entries,
    never the open last entry nor the newest position, and not name an
    entry again once it is dropped.

    Raises ``AssertionError`` with the first violation, ``RuntimeError``
    when a method of the policy raised (its words), ``TypeError`` when the
    object is not a policy.
    """
    _check(_instance("policy", policy), block_size)


def check_tier_policy(policy, block_size: int = 16) -> None:
    """Runs ``kvforge_quant::testing::check_tier_policy`` — the suite every
    Rust tier policy passes — on ``policy``: tables of every kind of entry
    (full and partial hot blocks, blocks with holes, cold and dropped
    ones, an open last entry) and length. Each answer must ascend, exist,
    name hot full entries without holes other than the open one, and name
    none of them again once they are cold.

    Raises ``AssertionError`` with the first violation, ``RuntimeError``
    when ``demote`` raised (its words), ``TypeError`` when the object is
    not a tier policy.
    """
    _check_tier(_instance("policy", policy), block_size)

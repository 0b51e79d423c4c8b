"""Conformance checks for policies written in Python: the Rust traits'
own suites, run on the Python object."""

from ._native import check_eviction_policy as _check


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
    _check(policy, block_size)

"""Worked examples of policies written in Python (importable by name from a
mechanisms table, e.g. ``policy = "kvforge.examples.keydiff:KeyDiff"``)."""

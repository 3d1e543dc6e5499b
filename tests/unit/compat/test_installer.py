"""`shardwise compat install-deepspeed`: detection passes, pip can remove it, a real DeepSpeed is kept."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.compat import installer


def test_install_status_uninstall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert installer.status(tmp_path).kind == "none"
    assert main(["compat", "install-deepspeed", "--target", str(tmp_path)]) == 0
    status = installer.status(tmp_path)
    assert (status.kind, status.version) == ("shardwise", installer.PACKAGE_VERSION)
    dist = next(iter(importlib.metadata.distributions(name="deepspeed", path=[str(tmp_path)])))
    assert dist.version.startswith("0.19.8+shardwise.")
    listed = {str(f) for f in dist.files or []}
    assert {"deepspeed/__init__.py", "bin/deepspeed"} <= listed  # RECORD: what pip uninstall removes
    init = (tmp_path / "deepspeed" / "__init__.py").read_text()
    assert "activate(__name__)" in init and "def " not in init  # no logic in the package
    assert (tmp_path / "bin" / "deepspeed").stat().st_mode & 0o111
    assert main(["compat", "status", "--target", str(tmp_path)]) == 0
    assert "compatibility package" in capsys.readouterr().out
    assert main(["compat", "uninstall-deepspeed", "--target", str(tmp_path)]) == 0
    assert installer.status(tmp_path).kind == "none"
    assert not (tmp_path / "deepspeed").exists() and not (tmp_path / "bin" / "deepspeed").exists()


def test_refuses_a_real_deepspeed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "deepspeed-0.19.8.dist-info"
    real.mkdir()
    (real / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (real / "INSTALLER").write_text("pip\n")
    assert installer.status(tmp_path).kind == "deepspeed"
    assert main(["compat", "install-deepspeed", "--target", str(tmp_path)]) == 1
    assert "a real DeepSpeed 0.19.8 is installed" in capsys.readouterr().err
    with pytest.raises(installer.CompatInstallError, match="not removing it"):
        installer.uninstall(tmp_path)
    assert not (tmp_path / "deepspeed").exists()

"""ruff and mypy on the project's own code, as configured in pyproject.toml."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy(tmp_path):
    """mypy on the package as it installs: photonic_testbed/ with a link to each folder, since
    mypy finds modules by their files' places, not by setuptools' package-dir."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    tree = tmp_path / "tree"
    for package, folder in sorted(package_dir.items()):
        place = tree.joinpath(*package.split("."))
        if "." not in package:      # the root: a folder of our own, its files linked, its
            place.mkdir(parents=True)   # subpackages' folders linked beside them below
            for path in (ROOT / folder).glob("*.py"):
                (place / path.name).symlink_to(path)
        else:
            place.symlink_to(ROOT / folder, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(tree)}
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                           str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                           "--no-error-summary", "-p", "photonic_testbed"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr).replace(
        "photonic_testbed/", "")   # paths in the repository: drivers/mesh.py, ...


def test_mypy_board(tmp_path):
    """mypy on the board's own files as the board runs them: `main` and `hal_board` top-level
    beside the command core `core`, with a stub of MicroPython's `machine` (the package run
    leaves their folder out: its name is no module name, and `machine` exists on the board
    only)."""
    board = ROOT / "firmware" / "rp2040-board"
    path = [ROOT / "firmware", board, ROOT / "tests" / "micropython" / "stubs"]
    env = {**os.environ, "MYPYPATH": os.pathsep.join(map(str, path))}
    modules = [arg for f in sorted(board.glob("*.py")) for arg in ("-m", f.stem)]
    assert modules, f"no board files in {board}"
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                           str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                           "--no-error-summary", *modules],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

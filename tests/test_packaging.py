"""The wheel: one import root of ours, the board's files as data, and a plain (non-editable)
install that runs from any directory."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ROOT_NAME = "photonic_testbed"


def test_every_package_folder_is_in_the_wheel_list():
    setup = PYPROJECT["tool"]["setuptools"]
    listed = set(setup["packages"])
    dirs = setup["package-dir"]
    on_disk = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([name, *rel.parts]))
    # folders of data only, listed so that setuptools ships them without a warning
    data = set(setup["package-data"]) - on_disk
    for name in data:
        root = max((k for k in dirs if name.startswith(k + ".")), key=len)
        folder = ROOT / dirs[root] / pathlib.Path(*name[len(root) + 1:].split("."))
        assert folder.is_dir() and not list(folder.glob("*.py")), name
    assert listed == on_disk | data


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel, built from the tracked files copied out of the checkout (as a clean clone)."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for f in filter(None, files):
        path = ROOT / f.decode()
        if path.is_file() and "node_modules" not in path.parts:
            (src / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / f.decode())
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (found,) = out.glob("photonic_testbed-*.whl")
    return found


def test_the_wheel_has_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert top == {ROOT_NAME}
    # the board's files travel as data beside the core they run, never as importable modules
    assert f"{ROOT_NAME}/firmware/rp2040-board/main.py" in names
    assert f"{ROOT_NAME}/firmware/rp2040-board/hal_board.py" in names
    assert f"{ROOT_NAME}/firmware/core.py" in names
    assert f"{ROOT_NAME}/hil/job/data/devils-dictionary.txt" in names     # the torch job's text
    assert not any(n.startswith(f"{ROOT_NAME}/firmware/rp2040-board/__init__") for n in names)
    assert not any(n.startswith("tests/") for n in names)


def test_a_plain_install_runs_from_any_directory(wheel, tmp_path):
    """Non-editable install in a fresh environment; the dependencies are borrowed from this
    one's site-packages by a path line (which loads none of its .pth files, so the editable
    finder of the checkout stays out)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "borrowed-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet",
                    "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "gui").mkdir()                       # a user's own folders must not shadow ours
    (elsewhere / "gui" / "__init__.py").write_text("raise ImportError('the wrong gui')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["QT_QPA_PLATFORM"] = "offscreen"

    def run(*args, timeout=120):
        return subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=timeout)

    where = run(str(py), "-c", f"import {ROOT_NAME}, sys; print({ROOT_NAME}.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(site), where.stdout
    assert run(str(py), "-c", "import drivers").returncode != 0
    assert run(str(py), "-c", "import hil").returncode != 0
    helped = run(str(venv / "bin" / "ptb"), "--help")
    assert helped.returncode == 0 and "emulate" in helped.stdout, helped.stderr
    gui = run(str(py), "-c", f"import {ROOT_NAME}.gui.window")
    assert gui.returncode == 0, gui.stderr

    proc = subprocess.Popen([str(venv / "bin" / "ptb"), "emulate", "--rig", "lumion",
                             "--endpoints", "ep.json"], cwd=elsewhere, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (elsewhere / "ep.json").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        assert (elsewhere / "ep.json").exists()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out

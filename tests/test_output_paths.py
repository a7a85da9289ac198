"""Every file or folder a `ptb` command writes is checked before any work starts: a missing
folder, a read-only folder and (where the format follows the name) an unknown suffix are each
one clear line naming the option, exit 1, nothing written, never a traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from photonic_testbed.ptb.cli import main

# (command words before the path, option, a good name for the path, words after it, folder?)
OUTPUTS = [
    (["emulate", "--rig", "lumion"], "--endpoints", "ep.json", [], False),
    (["emulate", "--rig", "lumion"], "--write-rig", "rig.toml", [], False),
    (["serve", "--rig", "none.toml"], "--endpoints", "ep.json", [], False),
    (["agent", "--rig", "none.toml"], "--journal", "agent.db", [], False),
    (["calibrate", "--rig", "lumion"], "--out", "cal.json", [], False),
    (["calibrate", "--rig", "lumion"], "--update", "cal.json", ["--cells", "c0"], False),
    (["calibrate", "--rig", "lumion", "--out", "CAL"], "--progress", "p.json", [], False),
    (["calibrate", "--rig", "lumion", "--out", "CAL"], "--report", "report", [], True),
    (["calibrate"], "--resave", "cal.json", [], False),
    (["discover", "--no-scan", "127.0.0.1:1"], "--out", "rig.toml", [], False),
    (["record", "ocs=127.0.0.1:1"], "--out", "s.jsonl", [], False),
    (["record", "ocs=127.0.0.1:1", "--out", "S"], "--write-endpoints", "ep.json", [], False),
    (["record", "ocs=127.0.0.1:1", "--out", "S"], "--link-dir", "links", [], True),
    (["replay", "none.jsonl"], "--report", "r.json", [], False),
    (["replay", "none.jsonl", "--as-device"], "--write-endpoints", "ep.json", [], False),
    (["replay", "none.jsonl", "--as-device"], "--link-dir", "links", [], True),
    (["bench", "ocs"], "--json", "b.json", [], False),
    (["keys", "operator"], "--dir", "keys", [], True),
    (["gui", "--demo-data", "--quit-after", "1"], "--screenshot", "w.png", [], False),
    (["gui", "--demo-data"], "--ready-file", "ready", [], False),
]
IDS = [f"{o[0][0]} {o[1]}" for o in OUTPUTS]


def ptb(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, err


@pytest.fixture
def read_only(tmp_path):
    """A folder nothing may be written in, for root too (immutable, `chattr +i`)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root, and no chattr +i here: no folder is read-only to root")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def _argv(case, path, tmp_path) -> list[str]:
    before, option, _, after, _ = case
    fill = {"CAL": str(tmp_path / "cal.json"), "S": str(tmp_path / "s.jsonl")}
    return [fill.get(w, w) for w in before] + [option, str(path)] + after


def _refused(capsys, argv, option, path, why: str) -> None:
    code, err = ptb(capsys, argv)
    assert code == 1, (argv, err)
    assert err.startswith(f"ptb {argv[0]}: {option} {path}: {why}"), (argv, err)
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("case", OUTPUTS, ids=IDS)
def test_a_missing_folder_is_refused_before_work(case, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "no" / "such"
    if case[4]:                      # a folder made with its parents: a file in the way
        (tmp_path / "no").write_text("a file\n")
        _refused(capsys, _argv(case, folder, tmp_path), case[1], folder, "a file is there")
    else:
        path = folder / case[2]
        _refused(capsys, _argv(case, path, tmp_path), case[1], path,
                 f"no folder {path.parent}")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["no"] if case[4] else [])


@pytest.mark.parametrize("case", OUTPUTS, ids=IDS)
def test_a_read_only_folder_is_refused_before_work(case, capsys, tmp_path, read_only,
                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = read_only / case[2]
    _refused(capsys, _argv(case, path, tmp_path), case[1], path,
             f"cannot write in {read_only}")
    assert list(read_only.iterdir()) == []


def test_a_screenshot_of_an_unknown_format_is_refused(capsys, tmp_path):
    for name in ("w.txt", "w", "w.png.gz"):
        path = tmp_path / name
        _refused(capsys, ["gui", "--demo-data", "--quit-after", "1", "--screenshot",
                          str(path)], "--screenshot", path, "the file's name must end in")
    assert list(tmp_path.iterdir()) == []


def test_the_gui_refuses_a_quit_after_that_is_not_a_time(capsys):
    for value in ("-1", "0", "1e9"):
        code, err = ptb(capsys, ["gui", "--demo-data", "--skip-display-check", "--quit-after",
                                 value])
        assert code == 1 and "--quit-after must be in (0, 86400]" in err


def test_a_failed_screenshot_is_an_error_not_a_silent_exit_0(tmp_path):
    """The folder vanishes while the window is up: Qt cannot save, and the GUI says so."""
    folder = tmp_path / "gone"
    folder.mkdir()
    code = ("import shutil, sys\n"
            "from photonic_testbed.ptb.cli import main\n"
            "from PySide6.QtCore import QTimer\n"
            f"QTimer.singleShot(0, lambda: shutil.rmtree({str(folder)!r}))\n"
            "sys.exit(main(['gui', '--demo-data', '--quit-after', '0.5', '--screenshot', "
            f"{str(folder / 'w.png')!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))
    assert done.returncode == 1, done
    assert "the screenshot could not be written" in done.stderr

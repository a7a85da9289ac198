"""Wrong arguments to `ptb demo`, `ptb keys`, `ptb journal` and `ptb bench`: each is a clear
message and a non-zero exit before anything starts, never a traceback (issue 15, item 10)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from photonic_testbed.hil.agent.entries import Note
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.ptb.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ptb(capsys, *argv: str) -> tuple[int, str, str]:
    """`ptb ARGV` in this process: (exit code, stdout, stderr); argparse's usage errors too."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_refuses_a_gpu_the_job_does_not_run_on_before_starting_anything(capsys, tmp_path):
    code, out, err = ptb(capsys, "demo", "--headless", "--gpu", "gpu99",
                         "--workdir", str(tmp_path))
    assert code == 1 and out == ""
    assert err.startswith("ptb demo: --gpu 'gpu99' is not in the lumion rack")
    assert "gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, gpu7" in err and "spare0" in err
    assert list(tmp_path.iterdir()) == []             # no process started, no log written
    code, _, err = ptb(capsys, "demo", "--gpu", "spare1", "--workdir", str(tmp_path))
    assert code == 1 and "is a spare, which the job does not run on" in err
    code, _, err = ptb(capsys, "demo", "--rig", "opus", "--gpu", "gpu3")
    assert code == 1 and "server0" in err and "not in the opus rack" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (("--seconds", "nan"), "--seconds must be in (0, 600], not nan"),
    (("--seconds", "inf"), "--seconds must be in (0, 600], not inf"),
    (("--seconds", "0"), "--seconds must be in (0, 600], not 0"),
    (("--seed", "-1"), "--seed must be >= 0, not -1"),
    (("--workdir", "/proc/no/such"), "cannot make --workdir /proc/no/such"),
])
def test_demo_refuses_bad_values(capsys, args, message):
    code, out, err = ptb(capsys, "demo", "--headless", *args)
    assert code == 1 and message in err and out == ""


def test_demo_refuses_a_workdir_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = ptb(capsys, "demo", "--workdir", str(f))
    assert code == 1 and "is not a folder" in err


def test_demo_usage_errors(capsys):
    for argv in (("demo", "--rig", "nope"), ("demo", "--seconds", "x")):
        code, _, err = ptb(capsys, *argv)
        assert code == 2 and "usage:" in err


@pytest.mark.parametrize("argv, message", [
    (("a", "--dir", "/proc/x"), "--dir /proc/x: cannot write in /proc"),
    (("a", "--dir", "/dev/null"), "--dir /dev/null: a file is there (/dev/null), not a folder"),
    (("../x",), "key name '../x'"),
    (("a/b",), "key name 'a/b'"),
    (("",), "key name ''"),
    ((".hidden",), "key name '.hidden'"),
    (("a", "b", "a"), "given twice: a"),
])
def test_keys_refuses_bad_names_and_folders(capsys, tmp_path, argv, message):
    argv = argv if "--dir" in argv else (*argv, "--dir", str(tmp_path / "keys"))
    code, out, err = ptb(capsys, "keys", *argv)
    assert code == 1 and message in err and out == ""
    assert not (tmp_path / "keys").exists() or list((tmp_path / "keys").iterdir()) == []


def test_keys_writes_nothing_when_one_name_exists(capsys, tmp_path):
    folder = tmp_path / "keys"
    assert ptb(capsys, "keys", "b", "--dir", str(folder))[0] == 0
    code, _, err = ptb(capsys, "keys", "a", "b", "--dir", str(folder), "--authorize")
    assert code == 1 and "b.key exists; refusing to overwrite it" in err
    assert sorted(p.name for p in folder.iterdir()) == ["b.key", "b.key_secret"]
    code, out, _ = ptb(capsys, "keys", "a", "--dir", str(folder), "--authorize")
    assert code == 0 and (folder / "authorized" / "a.key").exists()


def test_keys_authorized_that_is_a_file(capsys, tmp_path):
    (tmp_path / "authorized").write_text("")
    code, _, err = ptb(capsys, "keys", "a", "--dir", str(tmp_path), "--authorize")
    assert code == 1 and "authorized exists and is not a folder" in err


def test_journal_refuses_bad_arguments(capsys, tmp_path):
    path = tmp_path / "j.db"
    with SqliteJournal(path) as j:
        j.record(Note(), cause="one")
    assert ptb(capsys, "journal", str(path))[1].strip().endswith("note          (one)")
    for since in ("-1", str(2 ** 63), "x"):
        code, _, err = ptb(capsys, "journal", str(path), "--since", since)
        assert code == 2 and "argument --since" in err
    for bad, message in ((tmp_path / "none.db", "no journal at"),
                         ("/dev/null", "not a regular file"),
                         (tmp_path, "is a directory"),
                         (path / "x", "not a directory")):
        code, out, err = ptb(capsys, "journal", str(bad))
        assert code == 1 and message in err and out == ""
    assert not (tmp_path / "none.db").exists()             # ptb journal creates nothing


@pytest.mark.parametrize("argv", [
    ("failover", "--runs", "0"), ("phase", "--gap-ms", "-1"), ("soak", "--minutes", "0"),
    ("soak", "--period", "nan"), ("gui", "--size", "10x"), ("gui", "--rate", "inf"),
    ("ocs", "--seed", "-1"), ("bus", "--requests", "3"), ("dac", "--updates", "x"),
    ("mesh", "--repeats", "0"), ("calibrate", "--naive-points", "2"),
])
def test_bench_refuses_bad_values_before_running(capsys, argv):
    code, _, err = ptb(capsys, "bench", *argv)
    assert code == 2 and f"argument {argv[1]}" in err


def test_bench_refuses_a_results_file_it_cannot_write_before_running(capsys, tmp_path):
    code, out, err = ptb(capsys, "bench", "ocs", "--json", str(tmp_path / "no" / "r.json"))
    assert code == 1 and "no folder" in err and out == ""
    code, _, err = ptb(capsys, "bench", "ocs", "--json", str(tmp_path))
    assert code == 1 and "a folder is there, not a file" in err


def test_through_the_command_line_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for argv in (["demo", "--gpu", "gpu99"], ["keys", "a", "--dir", "/proc/x"],
                 ["journal", str(tmp_path / "none.db")]):
        out = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", *argv], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out
        assert "Traceback" not in out.stderr and out.stderr.startswith(f"ptb {argv[0]}: ")


def test_devices_may_be_named_on_either_side_of_an_option_and_once_each(capsys, tmp_path):
    """`ptb record dac=... --out f ocs=...`: every DEVICE=ADDRESS counts wherever it stands; a
    device named twice and an unknown option are refused before anything is opened."""
    out = str(tmp_path / "s.jsonl")
    code, _, err = ptb(capsys, "record", "ocs=127.0.0.1:1", "--out", out, "ocs=127.0.0.1:2")
    assert code == 1 and "device 'ocs' is named twice (127.0.0.1:1 and 127.0.0.1:2)" in err
    code, _, err = ptb(capsys, "record", "ocs=127.0.0.1:1", "--out", out, "oops")
    assert code == 1 and "'oops': expected DEVICE=ADDRESS" in err
    code, _, err = ptb(capsys, "replay", "ocs=127.0.0.1:1", "--bogus", "x")
    assert code == 2 and "unrecognized arguments: --bogus" in err
    code, _, err = ptb(capsys, "emulate", "--rig", "opus", "stray")
    assert code == 2 and "unrecognized arguments: stray" in err
    assert not (tmp_path / "s.jsonl").exists()


def test_serve_with_an_unreachable_instrument_says_so_in_one_line(tmp_path):
    """The service's process reports the failure to `ptb serve`, which says it once; the child
    prints no traceback of its own beside it (it did, now and then, as it raced its kill)."""
    (tmp_path / "rig.toml").write_text(
        '[rig]\nname = "r"\n[bus]\ncurve = false\n[devices.ocs]\nkind = "switch"\n'
        'driver = "photonic_testbed.drivers.ocs:OpticalCircuitSwitch"\n'
        'address = "TCPIP::127.0.0.1::1::SOCKET"\nrequest = "tcp://127.0.0.1:0"\n'
        'publish = "tcp://127.0.0.1:0"\n')
    for _ in range(3):
        out = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "serve", "--rig",
                              "rig.toml"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 1, out
        assert "Traceback" not in out.stderr, out.stderr
        assert out.stderr.splitlines()[-1].startswith("ptb serve: service ocs failed to start: "
                                                      "ServiceError: cannot open "), out.stderr

"""`ptb`'s parser is lazy: `ptb --help` imports no subcommand, `ptb X` imports only X."""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from photonic_testbed.ptb.cli import COMMANDS, build_parser, chosen_command, main

HEAVY = ("scipy", "numpy", "zmq", "PySide6", "matplotlib", "pyvisa", "serial")


def _imported_by(argv: list[str]) -> tuple[int, set[str]]:
    """Run `ptb ARGV` in a fresh interpreter; its exit code and the modules it imported."""
    code = (
        "import json, sys\n"
        "from photonic_testbed.ptb.cli import main\n"
        "try:\n"
        f"    rc = main({argv!r})\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        "sys.stdout.flush()\n"
        "print('\\n' + json.dumps([rc, sorted(sys.modules)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    rc, modules = json.loads(out.strip().splitlines()[-1])
    return rc, set(modules)


def test_help_imports_no_subcommand_and_no_heavy_library():
    rc, modules = _imported_by(["--help"])
    assert rc == 0
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert heavy == []
    assert not [m for m in modules if m.startswith("photonic_testbed.")
                and m not in ("photonic_testbed.ptb.cli",)
                and m not in ("photonic_testbed", "photonic_testbed.moved", "photonic_testbed.ptb")]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_parser_imports_the_chosen_subcommand_only(name, monkeypatch):
    """`ptb X ...` loads the module of X and no other (what X imports is X's business)."""
    import photonic_testbed.ptb.cli as cli
    loaded = []
    real = importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda module, *a: loaded.append(module) or real(module, *a))
    parser = build_parser(["-v", name, "--help"])
    subcommands = [m for m in loaded if m.rpartition(".")[0] == "photonic_testbed.ptb"]
    assert subcommands == [f"photonic_testbed.ptb.{name}"]
    with pytest.raises(SystemExit) as e:
        parser.parse_args([name, "--help"])
    assert e.value.code == 0


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_listed_help_is_the_subcommands_own(name):
    """COMMANDS (what `ptb --help` lists) says what each module registers."""
    parser = argparse.ArgumentParser(prog="ptb")
    importlib.import_module(f"photonic_testbed.ptb.{name}").add_parser(
        parser.add_subparsers(dest="command"))
    assert " ".join(COMMANDS[name].split()) in " ".join(parser.format_help().split())


def test_the_subcommand_is_found_after_ptbs_own_options():
    assert chosen_command(["-vv", "keys", "a"]) == "keys"
    assert chosen_command(["--verbose", "calibrate", "--help"]) == "calibrate"
    assert chosen_command(["--help"]) is None
    assert chosen_command(["no-such-command"]) is None
    assert chosen_command(["--", "keys"]) is None


def test_every_subcommand_is_listed_and_an_unknown_one_refused(capsys):
    text = build_parser(["--help"]).format_help()
    for name, help_line in COMMANDS.items():
        assert name in text and help_line.split()[0] in text
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


def test_the_chosen_subcommand_runs(tmp_path):
    assert main(["keys", "operator", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / "operator.key").exists() and (tmp_path / "operator.key_secret").exists()

"""The README's and the docs' code blocks run verbatim against the emulator
(conventions: tests/doc_blocks.py). One test per doc, each in its own empty folder."""
from __future__ import annotations

import pathlib

import pytest

from tests.doc_blocks import DocError, DocRun, read_blocks, run_doc

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")])

# Docs written for an API that another change of issue 14 brings: doc -> (what it waits for,
# the error it fails with until then). Any other failure fails; once the doc passes, the test
# fails until its entry here goes.
PENDING: dict[str, tuple[str, str]] = {}      # doc -> (why it cannot run yet, its error)


def test_every_doc_is_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "CHANGELOG.md", "docs/api.md", "docs/design.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_runs_verbatim(path, tmp_path):
    doc = path.relative_to(ROOT).as_posix()
    workdir = tmp_path / "doc"
    workdir.mkdir()
    try:
        run_doc(path, doc, workdir)
    except DocError as e:
        if doc in PENDING and PENDING[doc][1] in str(e):
            pytest.xfail(PENDING[doc][0])
        pytest.fail(str(e), pytrace=False)
    if doc in PENDING:
        pytest.fail(f"{doc} runs now: remove its entry from PENDING", pytrace=False)


def test_links_stay_in_the_repository():
    """Relative links of the docs point at files that exist in the repository."""
    import re
    missing = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.exists() or ROOT not in resolved.parents:
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert missing == []


# ---- the checker itself ------------------------------------------------------------------------

def _blocks(text: str):
    return read_blocks(text, "doc.md")


def test_a_block_without_a_language_is_refused():
    with pytest.raises(DocError, match="doc.md:2: a block needs a language"):
        _blocks("intro\n```\nptb --help\n```\n")


def test_unknown_languages_and_markers_are_refused():
    with pytest.raises(DocError, match="unknown block language 'console'"):
        _blocks("```console\n$ ptb --help\n```\n")
    with pytest.raises(DocError, match="is not one of"):
        _blocks("<!-- skip: slow -->\n```sh\nptb --help\n```\n")
    with pytest.raises(DocError, match="needs a reason"):
        _blocks("<!-- not run: -->\n```sh\nptb --help\n```\n")
    with pytest.raises(DocError, match="never closed"):
        _blocks("```sh\nptb --help\n")


def test_markers_are_read_above_the_block():
    (block,) = _blocks("<!-- not run: needs a board -->\n\n```python\nimport machine\n```\n")
    assert block.markers == {"not run": "needs a board"} and not block.runs
    (block,) = _blocks("<!-- file: a.toml -->\n```toml\nx = 1\n```\n")
    assert block.markers == {"file": "a.toml"} and block.line == 2


def _run(text: str, tmp_path) -> list[str]:
    runner = DocRun(tmp_path)
    try:
        for block in read_blocks(text, "doc.md"):
            runner.run(block)
    finally:
        problems = runner.close()
    return problems


def test_shell_and_python_blocks_run_in_the_docs_folder(tmp_path):
    text = ("<!-- file: data.toml -->\n```toml\nx = 1\n```\n"
            "```sh\necho hello > out.txt   # a comment\n```\n"
            "```python\nimport tomllib\nx = tomllib.load(open('data.toml', 'rb'))['x']\n```\n"
            "```python\nassert open('out.txt').read() == 'hello\\n' and x == 1\n```\n")
    assert _run(text, tmp_path) == []


def test_failures_name_the_doc_line(tmp_path):
    with pytest.raises(DocError, match=r"doc.md:1: `false` exited 1"):
        _run("```sh\nfalse\n```\n", tmp_path)
    with pytest.raises(DocError, match=r'(?s)doc.md:3: the block raised.*File "doc.md", line 5'):
        _run("text\n\n```python\nx = 1\nraise ValueError(x)\n```\n", tmp_path)
    with pytest.raises(DocError, match="not JSON"):
        _run("```json\n{\"a\": 1,}\n```\n", tmp_path)


def test_a_not_run_ptb_line_is_still_parsed(tmp_path):
    assert _run("<!-- not run: a real host -->\n```sh\nptb keys server --dir k\n```\n",
                tmp_path) == []
    assert not (tmp_path / "k").exists()
    with pytest.raises(DocError, match="ptb refuses"):
        _run("<!-- not run: a real host -->\n```sh\nptb keys --no-such-option\n```\n", tmp_path)


def test_a_background_command_runs_beside_the_next_lines_and_is_stopped(tmp_path):
    """As pasted into a shell: the next line starts at once, and waits by itself if it must."""
    script = tmp_path / "long.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
                      "time.sleep(0.3)\nopen('ready', 'w').close()\n"
                      "while True: time.sleep(0.1)\n")
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(DocError, match="`test -e ready` exited 1"):
        _run(f"```sh\npython {script} &\ntest -e ready\n```\n", work)
    (work / "ready").unlink(missing_ok=True)
    waits = "until test -e ready; do sleep 0.05; done"
    assert _run(f"```sh\npython {script} &\n{waits}\n```\n", work) == []


def test_a_background_command_that_ignores_ctrl_c_is_reported(tmp_path, monkeypatch):
    import tests.doc_blocks as doc_blocks
    monkeypatch.setattr(doc_blocks, "STOP_TIMEOUT_S", 1)
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "open('ignoring', 'w').close()\n"
                      "while True: time.sleep(0.1)\n")
    waits = "until test -e ignoring; do sleep 0.05; done"
    problems = _run(f"```sh\npython {script} &\n{waits}\n```\n", tmp_path)
    assert len(problems) == 1 and "did not stop on Ctrl-C" in problems[0]

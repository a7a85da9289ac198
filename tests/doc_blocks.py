"""The docs' fenced code blocks, read and run as a reader would run them.

Every fenced block of the README and docs/ says what it is by its language:

    ```sh       commands, one a line, run by bash in the doc's folder; `#` starts a comment and
                `\\` continues a line. A line ending in `&` is a long-running command (`ptb
                emulate`, `ptb serve`, `ptb agent`): it runs in the background and the next line
                starts at once, as when a reader pastes the block into a shell (whatever comes
                next waits for what it needs by itself: a file another command writes, `ptb
                status --wait`); it is stopped with Ctrl-C (SIGINT) when the doc ends and must
                exit 0.
    ```python   run in the doc's Python session: one interpreter per doc, its blocks in order
                sharing their names (like a notebook), in the doc's folder.
    ```json     must parse as JSON.             ```toml     must parse as TOML.
    ```text     not run: output, transcripts, diagrams, formulas, file layouts.

An HTML comment on the lines just above a block changes that:

    <!-- not run: REASON -->   an sh or python block a reader runs but the checker cannot
                               (a real host's GPUs, a window to close); its python is still
                               compiled, and its `ptb` lines are still parsed by `ptb`'s parser.
    <!-- file: NAME -->        the block is the content of a file the reader writes: the
                               checker writes it to NAME in the doc's folder (then checks it).

A block with no language, another language, or another such comment is an error: nothing is
skipped without a reason written next to it. Each doc runs in its own empty folder.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field

RUN_LANGS = ("sh", "python")
CHECK_LANGS = ("json", "toml")
QUIET_LANGS = ("text",)
MARKERS = ("not run", "file")

COMMAND_TIMEOUT_S = 900      # a foreground command or a python block (a calibration: ~1-2 min)
STOP_TIMEOUT_S = 60          # a background command's exit after Ctrl-C

_FENCE = re.compile(r"^( {0,3})```(.*)$")
_MARKER = re.compile(r"^<!--\s*([a-z][a-z ]*?)\s*:\s*(.*?)\s*-->\s*$")
_SESSION = pathlib.Path(__file__).with_name("doc_session.py")


class DocError(Exception):
    """A doc block that is malformed, or that failed when run."""


@dataclass
class Block:
    doc: str                 # the doc's path, as written in messages
    line: int                # line number of the opening fence (1-based)
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and "not run" not in self.markers


def read_blocks(text: str, doc: str) -> list[Block]:
    """Every fenced block of a Markdown text, with the markers just above it; a malformed
    block (no language, an unknown language or marker, an unclosed fence) raises DocError."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(r"^ {0,3}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise DocError(f"{doc}:{start + 1}: the block is never closed")
        i += 1
        where = f"{doc}:{start + 1}"
        if not lang:
            raise DocError(f"{where}: a block needs a language: sh or python (run), json or "
                           "toml (parsed), text (not run)")
        if lang not in RUN_LANGS + CHECK_LANGS + QUIET_LANGS:
            raise DocError(f"{where}: unknown block language {lang!r}; use one of "
                           f"{', '.join(RUN_LANGS + CHECK_LANGS + QUIET_LANGS)}")
        markers = _markers_above(lines, start, where)
        if "not run" in markers and lang not in RUN_LANGS:
            raise DocError(f"{where}: 'not run' is for sh and python blocks; a {lang} block "
                           "is never run")
        blocks.append(Block(doc, start + 1, lang, "\n".join(body) + "\n", markers))
    return blocks


def _markers_above(lines: list[str], start: int, where: str) -> dict[str, str]:
    markers: dict[str, str] = {}
    j = start - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    while j >= 0 and lines[j].lstrip().startswith("<!--"):
        m = _MARKER.match(lines[j].strip())
        if not m or m.group(1) not in MARKERS:
            raise DocError(f"{where}: the comment above the block, {lines[j].strip()!r}, is "
                           f"not one of: {', '.join(f'<!-- {k}: ... -->' for k in MARKERS)}")
        if not m.group(2):
            raise DocError(f"{where}: <!-- {m.group(1)}: --> needs a "
                           f"{'reason' if m.group(1) == 'not run' else 'file name'}")
        markers[m.group(1)] = m.group(2)
        j -= 1
    return markers


def commands(text: str) -> list[str]:
    """The commands of an sh block: `\\`-continued lines joined, blank and comment lines out."""
    out: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    if pending.strip():
        out.append(pending.strip())
    return out


def words(command: str) -> list[str]:
    """A command's words as the shell splits them (comments dropped, `&` `|` `;` on their own)."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def check_ptb_line(command: str, where: str) -> None:
    """A `ptb ...` line that is not run still has to be accepted by ptb's parser."""
    from photonic_testbed.ptb.cli import build_parser
    argv = words(command)
    if not argv or argv[0] != "ptb":
        return
    argv = argv[1:]
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:
        if e.code:
            raise DocError(f"{where}: ptb refuses {command!r} (exit {e.code})") from None


class DocRun:
    """One doc's blocks, run in order in `workdir`; `close()` stops what they started."""

    def __init__(self, workdir: pathlib.Path, env: dict[str, str] | None = None):
        self.workdir = workdir
        self.env = dict(os.environ if env is None else env)
        bindir = os.path.dirname(sys.executable)        # the `ptb` of the Python under test
        self.env["PATH"] = bindir + os.pathsep + self.env.get("PATH", "")
        self.env.setdefault("QT_QPA_PLATFORM", "offscreen")
        self.env["PYTHONUNBUFFERED"] = "1"
        self.background: list[tuple[str, subprocess.Popen, pathlib.Path]] = []
        self.session: subprocess.Popen | None = None
        self._replies = None
        self._count = 0
        self.timings: list[tuple[str, str, float]] = []   # (where, what, seconds)

    # ---- blocks ------------------------------------------------------------------------------

    def run(self, block: Block) -> None:
        if "file" in block.markers:
            self._write_file(block)
        if block.lang == "json":
            try:
                json.loads(block.text)
            except json.JSONDecodeError as e:
                raise DocError(f"{block.where}: not JSON: {e}") from None
        elif block.lang == "toml":
            try:
                tomllib.loads(block.text)
            except tomllib.TOMLDecodeError as e:
                raise DocError(f"{block.where}: not TOML: {e}") from None
        elif block.lang == "python":
            try:
                compile(block.text, block.where, "exec")
            except SyntaxError as e:
                raise DocError(f"{block.where}: not Python: {e}") from None
            if block.runs:
                t0 = time.monotonic()
                self._python(block)
                self.timings.append((block.where, "python", time.monotonic() - t0))
        elif block.lang == "sh":
            for command in commands(block.text):
                if block.runs:
                    t0 = time.monotonic()
                    self._shell(command, block.where)
                    self.timings.append((block.where, command, time.monotonic() - t0))
                else:
                    check_ptb_line(command, block.where)

    def _write_file(self, block: Block) -> None:
        name = pathlib.PurePosixPath(block.markers["file"])
        if name.is_absolute() or ".." in name.parts:
            raise DocError(f"{block.where}: file {name} must be a relative path in the doc's "
                           "folder")
        path = self.workdir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text)

    # ---- shell -------------------------------------------------------------------------------

    def _shell(self, command: str, where: str) -> None:
        argv = words(command)
        if argv and argv[-1] == "&":
            self._start_background(argv[:-1], command, where)
            return
        try:
            done = subprocess.run(["bash", "-c", command], cwd=self.workdir, env=self.env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise DocError(f"{where}: `{command}` still running after {COMMAND_TIMEOUT_S} s:\n"
                           f"{_tail(e.output)}") from None
        if done.returncode != 0:
            raise DocError(f"{where}: `{command}` exited {done.returncode}:\n"
                           f"{_tail(done.stdout)}")

    def _start_background(self, argv: list[str], command: str, where: str) -> None:
        if not argv or any(w in ("&", "|", ";", "&&", "||", "<", ">", ">>", "(", ")")
                           for w in argv):
            raise DocError(f"{where}: a background line is one simple command: {command!r}")
        self._count += 1
        log = self.workdir.parent / f"{self.workdir.name}-bg{self._count}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(["bash", "-c", "exec " + shlex.join(argv)],
                                    cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.background.append((command, proc, log))

    # ---- python ------------------------------------------------------------------------------

    def _python(self, block: Block) -> None:
        if self.session is None:
            self._start_session()
        assert self.session is not None and self.session.stdin is not None
        # blank lines in front, so that a traceback's line numbers are the doc's
        code = "\n" * block.line + block.text
        self.session.stdin.write(json.dumps({"code": code, "where": block.doc}) + "\n")
        self.session.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self._replies, selectors.EVENT_READ)
        ready = sel.select(COMMAND_TIMEOUT_S)
        sel.close()
        if not ready:
            raise DocError(f"{block.where}: the block still runs after {COMMAND_TIMEOUT_S} s:"
                           f"\n{_tail(self._session_log())}")
        line = self._replies.readline()
        if not line:
            raise DocError(f"{block.where}: the Python session ended (exit "
                           f"{self.session.wait(10)}):\n{_tail(self._session_log())}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise DocError(f"{block.where}: the block raised:\n{reply['error']}\noutput:\n"
                           f"{_tail(self._session_log())}")

    def _start_session(self) -> None:
        read_fd, write_fd = os.pipe()
        self._session_path = self.workdir.parent / f"{self.workdir.name}-python.log"
        with open(self._session_path, "w") as out:
            self.session = subprocess.Popen(
                [sys.executable, str(_SESSION), str(write_fd)], cwd=self.workdir, env=self.env,
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)

    def _session_log(self) -> str:
        return self._session_path.read_text(errors="replace")

    # ---- the end -----------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Stop the session, then the background commands (Ctrl-C, last started first); the
        problems seen, if any (a command that did not stop, or exited non-zero)."""
        problems = []
        if self.session is not None:
            assert self.session.stdin is not None
            self.session.stdin.close()
            try:
                self.session.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.session.pid, signal.SIGKILL)
                self.session.wait()
                problems.append("the Python session did not end when its input closed")
            if self._replies is not None:
                self._replies.close()
        for command, proc, log in reversed(self.background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    problems.append(f"`{command}` did not stop on Ctrl-C within "
                                    f"{STOP_TIMEOUT_S} s:\n{_tail(log.read_text())}")
                    continue
            if proc.returncode != 0:
                problems.append(f"`{command}` exited {proc.returncode}:\n"
                                f"{_tail(log.read_text(errors='replace'))}")
            if _kill_leftovers(proc.pid):
                problems.append(f"`{command}` left processes running after it exited")
        self.background.clear()
        return problems


def _kill_leftovers(pgid: int) -> bool:
    """Kill what an exited command left in its process group; whether there was any."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + 5      # children that are exiting by themselves
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
    os.killpg(pgid, signal.SIGKILL)
    return True


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def run_doc(path: pathlib.Path, doc: str, workdir: pathlib.Path) -> None:
    """Check and run every block of one doc in `workdir`; DocError on the first failure."""
    blocks = read_blocks(path.read_text(), doc)
    runner = DocRun(workdir)
    try:
        for block in blocks:
            runner.run(block)
    finally:
        problems = runner.close()
        for where, what, seconds in runner.timings:     # shown by pytest -s, or on a failure
            print(f"{seconds:6.1f} s  {where}  {what[:60]}")
    if problems:
        raise DocError(f"{doc}: " + "\n".join(problems))

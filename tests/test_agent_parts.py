"""The agent's shape: parts of a bounded size, and the bus process speaking to the agent
through its public names only (docs/agent.md, "The agent")."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENT = ROOT / "hil" / "agent"
MODULE_LINES, CLASS_LINES = 800, 500


def sizes(folder: pathlib.Path) -> list[str]:
    """Modules over MODULE_LINES lines and classes over CLASS_LINES, counted with ast."""
    out = []
    for path in sorted(folder.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MODULE_LINES:
            out.append(f"{path.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > CLASS_LINES:
                    out.append(f"{path.name}: class {node.name}, {lines} lines")
    return out


def privates_of_the_agent(source: str) -> list[str]:
    """Every `agent._x`, `a._x` or `self.agent._x` in `source`: a reach into the agent."""
    out: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("agent", "a") or \
                isinstance(owner, ast.Attribute) and owner.attr == "agent":
            out.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"line {line}: {text}" for line, _, text in sorted(out)]


def test_no_part_of_the_agent_is_too_big():
    assert sizes(AGENT) == []


def test_the_size_check_names_a_big_class(tmp_path):
    body = "\n".join(f"    x{k} = {k}" for k in range(CLASS_LINES))
    (tmp_path / "big.py").write_text(f"class Big:\n{body}\n")
    assert sizes(tmp_path) == [f"big.py: class Big, {CLASS_LINES + 1} lines"]


def test_the_agent_process_uses_the_agents_public_names_only():
    assert privates_of_the_agent((AGENT / "bus.py").read_text(encoding="utf-8")) == []


def test_a_reach_into_the_agent_is_found():
    source = ("with agent._lock:\n    agent._failed_at[g] = 0\n"
              "h = a._health\nself.agent._pool = None\nagent.jobs\n")
    assert privates_of_the_agent(source) == [
        "line 1: agent._lock", "line 2: agent._failed_at", "line 3: a._health",
        "line 4: self.agent._pool"]

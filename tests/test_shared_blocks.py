"""The blocks marked `# >>> shared: NAME` ... `# <<< shared: NAME` are one piece of code copied into each
algorithm file that uses it (each file must stand alone). Every copy must read exactly like the others."""
import difflib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["ppo.py", "grpo.py", "rloo.py"]
# Blocks every algorithm file holds: the arguments, data, generation, scoring, checks, alarms, checkpoints, dashboard and saving.
EVERYWHERE = {"arguments", "batch statistics", "scores", "models and data", "checks and alarms", "checkpoints, stop signals and bad steps", "set-up",
              "outputs and the starting policy's held-out score", "prompts", "generate and score", "dashboard", "evaluate, alarms, log and save"}
MARK = re.compile(r"^\s*# (>>>|<<<) shared: (.+?)\s*$")


def shared_blocks(text, name="file"):
    """{block name: its lines between the markers}; the markers must open and close in pairs, once per name."""
    blocks, open_name, lines = {}, None, []
    for number, line in enumerate(text.splitlines(), 1):
        mark = MARK.match(line)
        if not mark:
            if open_name is not None:
                lines.append(line)
            continue
        kind, block = mark.groups()
        if kind == ">>>":
            assert open_name is None, f"{name}:{number}: '{block}' opens inside '{open_name}'"
            assert block not in blocks, f"{name}:{number}: a second block named '{block}'"
            open_name, lines = block, []
        else:
            assert block == open_name, f"{name}:{number}: '{block}' closes, but '{open_name}' is open"
            blocks[block], open_name = "\n".join(lines), None
    assert open_name is None, f"{name}: '{open_name}' is never closed"
    return blocks


def drifted(files):
    """The differences between copies of each block, as unified diffs against the first file that holds it."""
    found = {}
    for path, text in files.items():
        for block, body in shared_blocks(text, path).items():
            found.setdefault(block, []).append((path, body))
    diffs = []
    for block, copies in found.items():
        (first, reference), *others = copies
        for path, body in others:
            if body != reference:
                diffs.append("".join(difflib.unified_diff(reference.splitlines(True), body.splitlines(True), f"{first}: {block}", f"{path}: {block}")))
    return diffs


def present():
    return {f: open(os.path.join(ROOT, f)).read() for f in FILES if os.path.exists(os.path.join(ROOT, f))}


def test_every_file_holds_every_common_block():
    files = present()
    assert "ppo.py" in files and "grpo.py" in files
    for path, text in files.items():
        missing = EVERYWHERE - set(shared_blocks(text, path))
        assert not missing, f"{path} lacks the shared blocks {sorted(missing)}"


def test_copies_have_not_drifted():
    diffs = drifted(present())
    assert not diffs, "shared blocks differ between files; change every copy the same way:\n" + "\n".join(diffs)


def test_drift_and_bad_markers_are_caught():
    a = "x = 1\n# >>> shared: one\ndef f():\n    return 1\n# <<< shared: one\n"
    assert drifted({"a.py": a, "b.py": a}) == []
    assert len(drifted({"a.py": a, "b.py": a.replace("return 1", "return 2")})) == 1
    assert len(drifted({"a.py": a, "b.py": a.replace("    return 1", "    return  1")})) == 1  # one space is drift too
    with pytest.raises(AssertionError, match="never closed"):
        shared_blocks("# >>> shared: one\nx = 1\n")
    with pytest.raises(AssertionError, match="closes, but"):
        shared_blocks("# >>> shared: one\nx = 1\n# <<< shared: two\n")

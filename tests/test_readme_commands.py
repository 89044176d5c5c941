"""The documents' commands must work as written: every `python X.py ...` or `torchrun ... X.py ...` line of the bash
blocks of README.md, docs/*.md and bench/README.md is parsed by that script's own Args (tyro, as the script does), so
a renamed or removed flag fails here, and a complete command then passes the script's own argument checks (batch sizes
that divide, over torchrun's number of processes). Lines with placeholders (<...>, ...) are parsed up to the
placeholder only. The hub models they name are not loaded (no hub here): the model-path check is the one check left
out."""

import importlib
import os
import re
import shlex

import pytest
import tyro
from helpers import readme_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("ppo.py", "grpo.py", "rloo.py", "dapo.py")
# The documents whose commands are checked, from the repository root (helpers.readme_files reads the same ones).
DOCUMENTS = [
    "README.md",
    *sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")),
    "bench/README.md",
]


def readme_commands():
    """(document, script, argv, processes, partial) for each script command in the documents' bash blocks,
    continuation lines joined."""
    commands = []
    for document in DOCUMENTS:
        commands += document_commands(document)
    return commands


def document_commands(document):
    """The script commands of one document's bash blocks."""
    text = open(os.path.join(ROOT, document)).read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line):
                words = shlex.split(part, comments=True)
                scripts = [i for i, w in enumerate(words) if w in SCRIPTS]
                if scripts:
                    argv = words[scripts[0] + 1 :]
                    cut = [i for i, w in enumerate(argv) if w.startswith("<") or w in ("...", "--args")]
                    if cut:
                        argv = argv[: cut[0]]
                        if argv and argv[-1].startswith("--"):  # the placeholder was that flag's value
                            argv = argv[:-1]
                    nproc = [int(w.split("=")[1]) for w in words[: scripts[0]] if w.startswith("--nproc_per_node=")]
                    commands.append((document, words[scripts[0]], argv, nproc[0] if nproc else 1, bool(cut)))
    return commands


COMMANDS = readme_commands()


def test_the_documents_have_commands_for_each_script():
    assert {c[1] for c in COMMANDS} == set(SCRIPTS)
    assert len(COMMANDS) >= 24  # the README's count before its text moved into docs/ and bench/README.md
    assert {c[0] for c in COMMANDS} >= {"README.md", "docs/results.md", "docs/recipes.md", "docs/long-runs.md"}


@pytest.mark.parametrize(
    "document,script,argv,nproc,partial", COMMANDS, ids=[f"{c[0]}: {c[1]} {' '.join(c[2])[:60]}" for c in COMMANDS]
)
def test_readme_command_parses_and_passes_the_checks(document, script, argv, nproc, partial, tmp_path, monkeypatch):
    module = importlib.import_module(script[:-3])
    try:
        args = tyro.cli(module.Args, args=argv, use_underscores=True)
    except SystemExit as e:
        pytest.fail(f"`{script} {' '.join(argv)}` from {document} does not parse (exit {e.code})")
    if partial:
        return
    monkeypatch.setattr(module, "check_model_path", lambda *a: None)
    args.output_dir, args.world_size = str(tmp_path / "out"), nproc
    shown = readme_files(tmp_path, DOCUMENTS)  # a reward function's file a document shows, as the user would write it
    for i, spec in enumerate(args.reward_fn):
        where, _, name = spec.rpartition(":")
        if where in shown:
            args.reward_fn = args.reward_fn[:i] + (f"{shown[where]}:{name}",) + args.reward_fn[i + 1 :]
    module.validate(args)  # raises SystemExit with its sentence when a check fails

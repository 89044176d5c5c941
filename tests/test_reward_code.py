"""Reward code run where it can always be stopped: each --reward_fn of the user's own runs in a process of its own, a
fresh interpreter in a process group that a timeout or a stop signal kills whole. Each case is a grader as people
write them (a shell command, a subprocess, a thread pool, a grader that catches the timeout, a lazy generator, one
with its own alarm, a math.py, two grader.py, an import that waits for a service, a random.py in the working folder)
and is compared with what must happen: the call or the loading ends within its timeout, nothing it started is left,
the failure is named as it happened, the scores are those of a plain loop."""

import importlib.util
import math
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy
import pytest
import test_robustness
from helpers import ENV, ROOT

import ppo

# test_robustness's fixture that gives pytest its signal handlers back (a fixture is found by its name in the module)
keep_signal_handlers = test_robustness.keep_signal_handlers

GRADERS = """
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PIDS = {pids!r}  # a file named after each grader, holding the process id of what it started


def shell(responses, answers):  # os.system: no Python code runs in this process until the shell ends
    os.system(f"echo $$ > {{PIDS}}/shell; exec sleep 120")


def popen(responses, answers):
    child = subprocess.Popen(["sleep", "120"])
    open(f"{{PIDS}}/popen", "w").write(str(child.pid))
    child.wait()


def threads(responses, answers):  # the pool's shutdown waits for its thread
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(time.sleep, 120).result()


def forgiving(responses, answers):  # a grader that takes a TimeoutError as "no answer": zeros
    try:
        time.sleep(120)
    except TimeoutError:
        pass
    return [0.0] * len(responses)


def lazy(responses, answers):  # a generator: the scores are computed as they are read
    for response in responses:
        time.sleep(120)
        yield 1.0


class OwnLimit(Exception):
    pass


def over_own_limit(signum, frame):
    raise OwnLimit("the grader's own 50 ms limit")


signal.signal(signal.SIGALRM, over_own_limit)


def own_alarm(responses, answers):
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    time.sleep(120)


def crashes(responses, answers):  # as a C extension's crash or an os._exit() would
    os._exit(3)


def where(responses, answers):  # the process it runs in: its threads, the trainer's torch, the default SIGTERM
    return [threading.active_count(), "torch" in sys.modules, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL]
"""


@pytest.fixture
def graders(tmp_path):
    (tmp_path / "pids").mkdir()
    (tmp_path / "graders.py").write_text(GRADERS.format(pids=str(tmp_path / "pids")))
    return tmp_path / "graders.py"


def alive(pid):
    """Whether a process runs (a zombie waiting for its parent does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


TIMED_OUT = "an error (TimeoutError: no answer within --reward_timeout 1 s)"


@pytest.mark.parametrize(
    "name, why",
    [
        ("shell", TIMED_OUT),  # before: the alarm could not interrupt os.system: the call took the whole 120 s
        ("popen", TIMED_OUT),  # before: the call timed out, its sleep went on
        ("threads", TIMED_OUT),  # before: the thread went on in the trainer, and kept it alive at the end
        ("forgiving", TIMED_OUT),  # before: the zeros it returned were trained on
        ("lazy", TIMED_OUT),  # before: the generator was read after the alarm was off: the call took 120 s
        ("own_alarm", "an error (OwnLimit: the grader's own 50 ms limit)"),  # before: its handler was replaced
        ("crashes", "an error (the process running it ended (exit code 3))"),  # before: the trainer ended with it
    ],
    ids=["shell", "popen", "threads", "forgiving", "lazy", "own_alarm", "crashes"],
)
def test_a_reward_call_ends_within_its_timeout_with_everything_it_started(graders, name, why):
    threads_before = threading.active_count()
    reward_fn = ppo.load_reward_fn(f"{graders}:{name}", 30)
    started = time.time()
    scores, reason = ppo.call_reward_fn(reward_fn, ["a response"], ["its answer"], 1)
    assert time.time() - started < 15
    assert reason == why
    assert math.isnan(scores[0])  # no score taken from it
    assert threading.active_count() == threads_before
    for path in (graders.parent / "pids").iterdir():
        assert gone(int(path.read_text())), path.name


def gone(pid, seconds=5):
    """Whether the process ends within a few seconds (SIGKILL is delivered, not waited for)."""
    deadline = time.time() + seconds
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_nothing_a_grader_started_outlives_the_trainer(graders):
    """The trainer killed with SIGKILL (none of its code runs) while its grader waits on a subprocess: the reward
    process sees the trainer's end of its stdin close and kills its group (before: the subprocess lived on)."""
    call = f"import ppo; ppo.call_reward_fn(ppo.load_reward_fn({str(graders)!r} + ':popen', 0), ['a'], [1], 0)"
    trainer = subprocess.Popen([sys.executable, "-c", call], cwd=ROOT, env=ENV)
    started = graders.parent / "pids" / "popen"
    while not started.exists() or not started.read_text():
        assert trainer.poll() is None
        time.sleep(0.05)
    trainer.kill()
    trainer.wait()
    assert gone(int(started.read_text()))


def test_a_stop_signal_ends_a_reward_call_at_once_whatever_the_timeout(graders):
    """SIGTERM or Ctrl-C (a signal in stops) while the grader hangs, under the default 600 s timeout: the call is
    left within a second, its process killed; the next call starts a fresh one."""
    reward_fn = ppo.load_reward_fn(f"{graders}:popen", 600)
    stops = []
    threading.Timer(0.5, stops.append, [signal.SIGTERM]).start()
    started = time.time()
    scores, reason = ppo.call_reward_fn(reward_fn, ["a", "b"], [1, 2], 600, stops)
    assert time.time() - started < 5
    assert reason == "stopped by a signal"
    assert reward_fn.process is None
    assert ppo.call_reward_fn(reward_fn, ["a"], [1], 1)[1] == TIMED_OUT  # a fresh process, killed again


def test_reward_code_never_runs_in_a_fork_of_the_trainer(graders, keep_signal_handlers):
    """A grader's process pool forks the process the grader runs in. Forked from the trainer, its workers had the
    trainer's SIGTERM handler until an at-fork hook put the default back: a worker not yet run when the pool ended
    swallowed the pool's SIGTERM, and Pool.__exit__ waited for it forever (2 of 25 runs, on a loaded machine); a
    fork also copies locks the trainer's other threads hold. The grader runs in a fresh interpreter: no torch, the
    default SIGTERM, and no other thread (what waits for the trainer's end is a process of its own)."""
    ppo.catch_stop_signals()  # the trainer's handlers
    other_thread = threading.Thread(target=time.sleep, args=(5,), daemon=True)  # the trainer has other threads
    other_thread.start()
    assert "torch" in sys.modules
    scores = ppo.call_reward_fn(ppo.load_reward_fn(f"{graders}:where", 10), ["a", "b", "c"], [1, 2, 3], 10)
    assert scores == ([1.0, 0.0, 1.0], None)


def test_a_reward_process_started_again_runs_the_code_the_run_began_with(graders, tmp_path):
    """The reward process is sent this file's functions as source. After a timeout or a stop it is started again,
    and by then the file may have been edited (a git pull during a long run): the program read from the file then, at
    line numbers that no longer hold, did not compile, and the trainer died of the reset connection. It is read
    once, when the run begins."""
    copy = tmp_path / "trainer_copy.py"
    copy.write_text((pathlib.Path(ROOT) / "ppo.py").read_text())
    found = importlib.util.spec_from_file_location("trainer_copy", copy)
    trainer = importlib.util.module_from_spec(found)
    found.loader.exec_module(trainer)
    reward_fn = trainer.load_reward_fn(f"{graders}:where", 10)
    first = trainer.call_reward_fn(reward_fn, ["a", "b", "c"], [1, 2, 3], 10)
    copy.write_text("# edited while the run goes on\n" * 7 + copy.read_text())
    reward_fn.kill()  # as a timeout or a stop does: the next call starts a new process
    assert trainer.call_reward_fn(reward_fn, ["a", "b", "c"], [1, 2, 3], 10) == first == ([1.0, 0.0, 1.0], None)
    reward_fn.kill()


def test_reward_files_shadow_nothing_and_two_of_one_name_both_work_with_process_pools(tmp_path):
    """A user's math.py and numpy.py replace neither module, here or in the grader's process; two grader.py in two
    folders are two modules, each pickled by a process pool as itself. Their folders are not put on sys.path here."""
    pooled = (
        "import multiprocessing\n"
        "import math\n"
        "def one(pair):\n"
        "    return math.sqrt({value}) * len(pair[0])\n"
        "def score(responses, answers):\n"
        "    with multiprocessing.Pool(2) as pool:\n"
        "        return pool.map(one, list(zip(responses, answers)))\n"
    )
    folders = {}
    for name, value in (("math", 4), ("numpy", 9), ("grader", 16), ("other/grader", 25)):
        path = tmp_path / f"{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(pooled.format(value=value))
        folders[name] = path
    path_before = list(sys.path)
    texts = ["a", "bb", "ccc"]
    for name, value in (("math", 4), ("numpy", 9), ("grader", 16), ("other/grader", 25)):
        reward_fn = ppo.load_reward_fn(f"{folders[name]}:score", 30)
        expected = [value**0.5 * len(t) for t in texts]
        assert ppo.call_reward_fn(reward_fn, texts, [1, 2, 3], 30) == (expected, None), name
    assert sys.modules["math"].sqrt(4) == 2.0
    assert sys.modules["numpy"] is numpy
    assert sys.path == path_before


def test_several_functions_a_failure_names_its_function_and_a_none_is_said(tmp_path):
    """Two rules: the first fails on 'nine' (the third response), the second returns None for '5' (the first). The
    response named is the first that failed, with the reason and the --reward_fn of the rule that failed on it
    (before: the first rule's error, pinned on a response it scored), and a None is said as such (before:
    "TypeError: float() argument ..."): TRL's "does not apply" is refused."""
    from test_robustness import scored

    def first(texts, answers):
        return [float(int(t) == int(a)) for t, a in zip(texts, answers)]  # int("nine") raises

    def second(texts, answers):
        return [None if t == "5" else 0.5 for t in texts]

    spec = f"{tmp_path}/rules.py:second"
    with pytest.raises(
        SystemExit,
        match=r"the response '5' to the prompt 'what is 2\+3\?' is None \(TRL's 'does not apply' is not taken here: "
        rf"return a float for every response\) \(--reward_fn {spec}\); fix the reward",
    ):
        scored(first, more=[(spec, second)])


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(reward_timeout=1e-9), "--reward_timeout must be 0 (no limit) or from 0.1 s"),
        (dict(reward_timeout=1e10), "--reward_timeout must be 0 (no limit) or from 0.1 s"),
        (
            dict(reward_fn=("a/grader.py:score", "b/grader.py:score")),
            "--reward_fn gives two functions one name, and each logs its scores as reward/<name>; rename one",
        ),
    ],
    ids=["timeout 1e-9", "timeout 1e10", "two functions of one name"],
)
def test_reward_options_out_of_range_are_refused_in_one_sentence(changes, message):
    args = ppo.Args(**changes)
    with pytest.raises(SystemExit, match="^" + re.escape(message)):
        ppo.check_common_args(args, args.rollout_batch_size)


HANGS_AT_IMPORT = """
import os
import subprocess
import time

if os.path.exists({mark!r}):  # loaded before: its service is down now, and the import waits on a program
    waiting = subprocess.Popen(["sleep", "120"])
    open({pid!r}, "w").write(str(waiting.pid))
    waiting.wait()
open({mark!r}, "w").close()


def score(responses, answers):
    time.sleep(120)
"""


def test_a_reward_file_whose_import_hangs_is_refused_within_the_timeout(tmp_path):
    """The grader's service is down when the run begins: loading it is refused within --reward_timeout, and what its
    import started is killed (before, the start waited on the pipe with no timeout: the run hung before any model)."""
    (tmp_path / "loaded").write_text("")
    path = tmp_path / "grader.py"
    path.write_text(HANGS_AT_IMPORT.format(mark=str(tmp_path / "loaded"), pid=str(tmp_path / "pid")))
    started = time.time()
    with pytest.raises(SystemExit) as refused:
        ppo.load_reward_fn(f"{path}:score", 3)
    assert time.time() - started < 15
    assert refused.value.code == (
        f"--reward_fn {path}:score: loading it gave no answer within --reward_timeout 3 s; check what its import "
        "waits for, or pass a longer --reward_timeout."
    )
    assert gone(int((tmp_path / "pid").read_text()))


def test_a_reward_process_started_again_ends_on_a_stop_or_its_timeout_while_loading(tmp_path):
    """A call times out and its process is killed; the next call starts it again, and by then the import hangs (the
    service went down). A stop signal ends that start within a second, a timeout within --reward_timeout, each
    killing what the import started (before, the start waited on the pipe forever and a SIGTERM did nothing)."""
    path = tmp_path / "grader.py"
    path.write_text(HANGS_AT_IMPORT.format(mark=str(tmp_path / "loaded"), pid=str(tmp_path / "pid")))
    reward_fn = ppo.load_reward_fn(f"{path}:score", 30)
    assert ppo.call_reward_fn(reward_fn, ["a"], [1], 1)[1] == TIMED_OUT
    stops = []
    stopped_at = []

    def stop_once_the_import_waits():
        while not (tmp_path / "pid").exists():
            time.sleep(0.05)
        stopped_at.append(time.time())
        stops.append(signal.SIGTERM)

    threading.Thread(target=stop_once_the_import_waits, daemon=True).start()
    scores, reason = ppo.call_reward_fn(reward_fn, ["a"], [1], 600, stops)
    assert time.time() - stopped_at[0] < 2
    assert reason == "stopped by a signal"
    assert math.isnan(scores[0])
    assert reward_fn.process is None
    assert gone(int((tmp_path / "pid").read_text()))
    (tmp_path / "pid").unlink()
    started = time.time()
    scores, reason = ppo.call_reward_fn(reward_fn, ["a"], [1], 3)
    assert time.time() - started < 15
    assert reason == (
        f"an error (TimeoutError: --reward_fn {path}:score: loading it gave no answer within --reward_timeout 3 s; "
        "check what its import waits for, or pass a longer --reward_timeout.)"
    )
    assert gone(int((tmp_path / "pid").read_text()))


STANDARD_NAMES = "raise ImportError('{where} random.py was imported in place of the standard library\\'s')\n"


def test_modules_of_standard_names_in_the_working_folder_or_beside_the_file_shadow_nothing(tmp_path, monkeypatch):
    """A random.py in the working folder and beside the reward file: the reward process's own imports (tempfile
    imports random) and the grader's `import random` get the standard library's, and a module beside the file still
    imports (before, the process died importing the working folder's random.py, and the message blamed the file)."""
    work = tmp_path / "work"
    rules = tmp_path / "rules"
    for folder in (work, rules):
        folder.mkdir()
        (folder / "random.py").write_text(STANDARD_NAMES.format(where=folder.name))
    (rules / "helper.py").write_text("BONUS = 0.5\n")
    (rules / "grader.py").write_text(
        "import random\n"
        "import helper\n"
        "def score(responses, answers):\n"
        "    return [helper.BONUS + random.Random(len(r)).random() for r in responses]\n"
    )
    monkeypatch.chdir(work)
    texts = ["a", "bb"]
    expected = [0.5 + random.Random(len(t)).random() for t in texts]
    reward_fn = ppo.load_reward_fn(f"{rules / 'grader.py'}:score", 30)
    assert ppo.call_reward_fn(reward_fn, texts, [1, 2], 30) == (expected, None)

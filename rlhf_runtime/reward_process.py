"""The reward process: your --reward_fn runs in a fresh interpreter of its own, in a process group that a timeout or
a stop kills whole, and is called in the form it was written for (this project's, TRL's, verl's or OpenRLHF's). The
guarantee: a hung or crashing grader never hangs or kills the trainer, and it ends with the trainer however that ends.
"""

import asyncio
import functools
import hashlib
import importlib.util
import inspect
import multiprocessing.connection
import os
import pathlib
import pkgutil
import signal
import subprocess
import sys
import time
import types


class RewardProcess:
    """Your --reward_fn in a fresh interpreter (never a fork of this one, whose threads may hold locks), in a process
    group of its own that a timeout or a stop kills whole; started again at the next call; it ends with the trainer.
    form: whose form the function is in (reward_form); required: the arguments it names without a default."""

    # rlhf_runtime.tools.ToolProcess runs a --tools function the same way: these, and what the process says, differ
    option = "--reward_fn"  # the option that names the function, and the one that bounds its time
    timeout_option = "--reward_timeout"
    server = "serve_rewards"  # the function that the process runs

    def __init__(self, spec):
        self.spec = spec
        self.process = None
        self.connection = None
        self.form = None
        self.required = []

    def code(self):
        """The process's program, without the call of its server."""
        return reward_process_code()

    def hello(self):
        """The first message: where modules are found, and the function to load."""
        return sys.path, self.spec

    def loaded(self, got):
        """What the process says once the function is loaded: its form and required arguments."""
        self.form, self.required = got

    def start(self, timeout, stops):
        """Starts the process and loads the function there, bounded as a call: None, or (kind, the sentence why not)."""
        ours, theirs = multiprocessing.Pipe()
        program = f"{self.code()}\n{self.server}({theirs.fileno()})"
        # -P: the working folder is not first on its path, where a random.py would shadow the standard library's
        command = [sys.executable, "-P", "-u", "-c", program]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, pass_fds=[theirs.fileno()], start_new_session=True
        )
        theirs.close()
        self.connection = ours
        kind, got = self.ask(self.hello(), timeout, stops)
        if kind == "loaded":
            self.loaded(got)
            return None
        if self.process is not None:  # resolve_reward_fn's sentence: the process ends
            self.kill()
        if kind == "timeout":  # a grader whose import waits for a service that is down
            got = f"loading it gave {got}; check what its import waits for, or pass a longer {self.timeout_option}."
        return kind, f"{self.option} {self.spec}: {got}"

    def call(self, batch, timeout, stops):
        """ask's answer to batch (score_responses'), the process started first where it is not."""
        if stops and any(isinstance(r, int) for r in stops):  # the run is stopping: no call begins
            return "stopped", None
        if self.process is None:
            failed = self.start(timeout, stops)
            if failed:
                return failed
        return self.ask(batch, timeout, stops)

    def ask(self, message, timeout, stops):
        """Sends message and gives the process's answer, or ("stopped", None) as soon as stops holds a signal,
        ("timeout", why) after timeout seconds (0: no limit), ("raised", why) if it ended: its group then killed."""
        try:
            self.connection.send(message)
            end = time.monotonic() + timeout
            while not self.connection.poll(0.1):  # a tenth of a second: a stop is seen at once
                if stops and any(isinstance(r, int) for r in stops):
                    self.kill()
                    return "stopped", None
                if timeout and time.monotonic() > end:
                    self.kill()
                    return "timeout", f"no answer within {self.timeout_option} {timeout:g} s"
            return self.connection.recv()
        except (EOFError, OSError):  # it ended: os._exit(), a crash, a kill from outside (a broken pipe)
            return "raised", f"the process running it ended (exit code {self.kill()})"

    def kill(self):
        """Kills the process group: the process and what its function started (unless that left the group)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # every member had ended
            pass
        code = self.process.wait()
        self.process.stdin.close()
        self.connection.close()
        self.process = None
        return code


@functools.cache  # read once: the file may be edited or replaced while the run goes on
def reward_process_code():
    """The reward process's program: the functions of this file that it runs, as they were when the run began."""
    imports = "import asyncio, hashlib, importlib.util, inspect, multiprocessing.connection, os, pathlib, pkgutil"
    imports += ", signal, sys, types"
    shipped = (
        reward_module,
        resolve_reward_fn,
        load_function,
        package_spec,
        reward_form,
        reward_reply,
        call_in_form,
        call_with,
        finished,
        watch_trainer,
        serve_rewards,
    )
    return "\n".join([imports, *map(inspect.getsource, shipped)])


def reward_module(path):
    """In the reward process: a user's reward file as a module named after its stem and resolved path, so that it
    shadows nothing (a math.py, two grader.py); in sys.modules for a forked pool, its folder last on sys.path."""
    resolved = os.path.realpath(path)
    name = f"{pathlib.Path(path).stem}_{hashlib.sha1(resolved.encode()).hexdigest()[:12]}"
    sys.path.append(os.path.dirname(resolved))  # for the modules beside it
    found = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    found.loader.exec_module(module)
    return module


def resolve_reward_fn(spec):
    """In the reward process: (the function spec names, its form), or (None, why not: start puts the --reward_fn
    first)."""
    fn, failure = load_function(spec)
    if fn is None:
        return None, failure
    form = reward_form(fn)
    if form is None:
        return None, (
            f"{fn.__name__}{inspect.signature(fn)} is in none of the forms taken: fn(responses, answers) (this "
            "project's), fn(prompts, completions, **kwargs) (TRL's), compute_score(data_source, solution_str, "
            "ground_truth, extra_info) (verl's), reward_func(queries, prompts, labels) (OpenRLHF's)."
        )
    return fn, form


def load_function(spec):
    """In a function's process: (the function spec, file.py:fn or module:fn, names, None), or (None, why not)."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            module = reward_module(where)
        else:
            module = pkgutil.resolve_name(where)
    except BaseException as e:  # sys.exit() at import too
        failure = f"'{where}' could not be loaded ({type(e).__name__}: {e})"
        if where.endswith(".py") and isinstance(e, ImportError) and "relative import" in str(e):
            module, top = package_spec(where)  # a file of a package, importing its neighbours as .name
            return None, (
                f"{failure}: it is a module of a package; pass --reward_fn {module}:{name}, with the folder that "
                f"holds {top}/ on PYTHONPATH."
            )
        return None, f"{failure}; fix it, or check the module's name and that it is importable from here."
    fn = getattr(module, name, None)
    if not callable(fn):
        return None, f"'{where}' has no function '{name}'; name one it defines."
    return fn, None


def package_spec(path):
    """A file's module name within its package (the folders above it with an __init__.py, at least its own folder),
    and the package's top folder: pkg/sub/rules.py gives ("pkg.sub.rules", "pkg")."""
    file = pathlib.Path(os.path.realpath(path))
    parts = [file.parent.name, file.stem]
    folder = file.parent
    while (folder.parent / "__init__.py").exists():
        folder = folder.parent
        parts.insert(0, folder.name)
    return ".".join(parts), folder.name


def reward_form(fn):
    """Whose convention fn is written in, told by its arguments' names: verl's names solution_str, OpenRLHF's
    queries, TRL's completions (or takes keywords alone: a decorator's wrapper(*args, **kwargs) too), this project's
    fn(responses, answers); None: no one's."""
    try:
        arguments = inspect.signature(fn).parameters
    except ValueError:  # a callable whose signature cannot be read (a builtin): taken as this project's
        return "this project's"
    if "solution_str" in arguments:
        return "verl's"
    if "queries" in arguments:
        return "OpenRLHF's"
    kinds = {a.kind for a in arguments.values()} - {inspect.Parameter.VAR_POSITIONAL}
    if "completions" in arguments or kinds == {inspect.Parameter.VAR_KEYWORD}:  # fn(**kwargs), wrapper(*args, **kwargs)
        return "TRL's"
    try:
        inspect.signature(fn).bind(["a response"], ["its answer"])
    except TypeError:
        return None
    return "this project's"


def reward_reply(fn, form, batch):
    """fn called in its form on batch as ("scores", (a float or None each, {extra_logs key: a float each})), a
    generator consumed here; ("returned", what it was) when not a score each, or ("raised", "Type: message")."""
    n = len(batch["responses"])
    try:
        got, extra_logs = call_in_form(fn, form, batch)
        if not hasattr(got, "__iter__") or isinstance(got, (str, bytes, dict)):
            return "returned", f"a {type(got).__name__}"
        logs = {}
        for key, values in extra_logs.items():  # a number for the batch (a 0-d tensor), or one per response
            if hasattr(values, "tolist"):  # a tensor or an array
                values = values.tolist()
            if not isinstance(values, (list, tuple)):
                values = [values] * n
            if len(values) != n:
                return "returned", f"extra_logs['{key}'] of {len(values)} values"
            logs[key] = [float(x) for x in values]
        return "scores", ([None if x is None else float(x) for x in got], logs)
    except BaseException as e:  # sys.exit() or KeyboardInterrupt in reward code too: a failure, never the run's exit
        return "raised", f"{type(e).__name__}: {e}"


def call_in_form(fn, form, batch):
    """fn's scores for batch (score_responses'), called as the project whose form it is calls it, and the metrics it
    asks to log (OpenRLHF's extra_logs; {} in the other forms)."""
    if form == "TRL's":  # as TRL's GRPOTrainer: the prompts as the data holds them, a chat's completions as messages
        # every column of the data, None where a row has none (load_prompts gives every row each column)
        columns = {key: [row.get(key) for row in batch["columns"]] for key in batch["columns"][0]}
        completions = batch["responses"]
        if batch.get("completion_messages"):  # a conversation with tools: its turns, as TRL passes them
            completions = batch["completion_messages"]
        elif isinstance(batch["prompts"][0], list):
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        trainer_state = types.SimpleNamespace(global_step=batch["step"], max_steps=batch["max_steps"])
        given = dict(prompts=batch["prompts"], completions=completions, completion_ids=batch["completion_ids"])
        return call_with(fn, {**columns, **given, "trainer_state": trainer_state}), {}
    if form == "verl's":  # each response alone, as verl's reward manager: a number, or a dict with it as "score"
        scores = []
        for text, answer, row in zip(batch["responses"], batch["answers"], batch["columns"]):
            given = dict(solution_str=text, ground_truth=answer, extra_info=row.get("extra_info"))
            got = call_with(fn, {"data_source": row.get("data_source"), **given})
            scores.append(got["score"] if isinstance(got, dict) else got)
        return scores, {}
    if form == "OpenRLHF's":  # a tensor, a list, or a dict with them as "rewards" and its metrics as "extra_logs"
        got = call_with(fn, dict(queries=batch["queries"], prompts=batch["prompt_texts"], labels=batch["answers"]))
        if isinstance(got, dict):
            return got["rewards"], got.get("extra_logs", {})
        return got, {}
    return finished(fn(batch["responses"], batch["answers"])), {}


def call_with(fn, given):
    """fn(**given), leaving out the keywords it does not take, unless it takes **kwargs; an async def's awaited."""
    arguments = inspect.signature(fn).parameters
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in arguments.values()):
        given = {key: value for key, value in given.items() if key in arguments}
    return finished(fn(**given))


def finished(got):
    """A function's answer: a coroutine (an async def's, which TRL's trainers await) run to its end first."""
    if inspect.iscoroutine(got):
        return asyncio.run(got)
    return got


def watch_trainer(fd):
    """Forks the watcher, before any of your code runs (a thread would make every later fork, a pool, a risk): it
    kills the process group once the trainer's end of stdin closes, however the trainer ended."""
    if os.fork() == 0:
        os.close(fd)  # the trainer's connection: its end is seen to close when the function's process ends
        os.read(0, 1)
        os.killpg(0, signal.SIGKILL)


def serve_rewards(fd):
    """The reward process: loads the function, says whether it could (and its form and required arguments), then
    answers each batch sent. It ends with the trainer, however that ends: its watcher kills the process group once
    the trainer's stdin closes."""
    watch_trainer(fd)
    connection = multiprocessing.connection.Connection(fd)
    search_path, spec = connection.recv()
    sys.path[:] = search_path  # the trainer's: its modules found as they would be there
    fn, form = resolve_reward_fn(spec)
    if fn is None:
        connection.send(("raised", form))
        return
    arguments = inspect.signature(fn).parameters.values() if form == "TRL's" else []
    required = [a.name for a in arguments if a.default is a.empty and a.kind not in (a.VAR_POSITIONAL, a.VAR_KEYWORD)]
    connection.send(("loaded", (form, required)))
    while True:
        try:
            batch = connection.recv()
        except EOFError:  # the trainer ended
            return
        connection.send(reward_reply(fn, form, batch))

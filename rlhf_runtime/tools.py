"""Tools: your --tools functions, each in a process of its own, their JSON schemas for the chat template, the calls
read from the policy's turn, and the tool messages rendered by the chat template as tokens. The guarantee: whatever
the policy writes (no JSON, a tool that does not exist, wrong arguments, a call that hangs or crashes its process), it
gets a tool message saying so, counted in the metrics, and the run goes on; a tool's process ends with the trainer.
"""

import inspect
import json
import re
import sys
from dataclasses import dataclass, field

from rlhf_runtime.reward_process import RewardProcess, reward_process_code

LOADING_S = 60.0  # the least time a tool's process has to start and load it


class ToolProcess(RewardProcess):
    """A --tools function in a process of its own, as a reward function runs (RewardProcess): a fresh interpreter in
    a process group that a timeout or a stop kills whole, started again at the next call. schema: its JSON schema,
    read once there by transformers' get_json_schema (its type hints and docstring, as TRL reads a tool)."""

    option = "--tools"
    timeout_option = "--tool_timeout"
    server = "serve_tool"

    def __init__(self, spec):
        super().__init__(spec)
        self.schema = None

    def code(self):
        """The reward process's program and serve_tool."""
        return f"import json\n{reward_process_code()}\n{inspect.getsource(serve_tool)}"

    def start(self, timeout, stops):
        """RewardProcess.start, its loading bounded apart from the calls: by LOADING_S at least (the first start imports
        transformers to read the schema, seconds that a short --tool_timeout must not refuse)."""
        return super().start(max(timeout, LOADING_S) if timeout else 0, stops)

    def hello(self):
        """Where modules are found, the function, and whether to read its schema (only at the first start)."""
        return sys.path, self.spec, self.schema is None

    def loaded(self, got):
        """The function's schema, read at the first start."""
        self.schema = self.schema or got


def serve_tool(fd):
    """The tool process: loads the function (and, at the first start, says its schema), then runs each call sent,
    arguments by name: ("result", its answer as text), or ("raised", "Type: message")."""
    watch_trainer(fd)  # noqa: F821 (shipped beside this function by reward_process_code)
    connection = multiprocessing.connection.Connection(fd)  # noqa: F821
    search_path, spec, read_schema = connection.recv()
    sys.path[:] = search_path  # the trainer's: its modules found as they would be there
    fn, failure = load_function(spec)  # noqa: F821
    schema = None
    if fn is not None and read_schema:
        try:
            from transformers.utils import get_json_schema

            schema = get_json_schema(fn)
        except Exception as e:
            fn = None
            failure = f"its schema could not be read ({type(e).__name__}: {e}); give it type hints and a docstring "
            failure += "with an Args: section naming each argument, as transformers' get_json_schema reads them."
    if fn is None:
        connection.send(("raised", failure))
        return
    connection.send(("loaded", schema))
    while True:
        try:
            arguments = connection.recv()
        except EOFError:  # the trainer ended
            return
        try:
            got = finished(fn(**arguments))  # noqa: F821
            text = got if isinstance(got, str) else json.dumps(got) if isinstance(got, (dict, list)) else str(got)
            connection.send(("result", text))
        except BaseException as e:  # sys.exit() in a tool too: its answer, never the process's end
            connection.send(("raised", f"{type(e).__name__}: {e}"))


@dataclass
class Tools:
    """The tools a policy may call: each name's process, their schemas (what the chat template renders), the most
    seconds a call may take (0: no limit) and the run's stops (a stop signal ends a call at once)."""

    processes: dict
    schemas: list
    timeout: float
    stops: list = field(default_factory=list)

    def names(self):
        return ", ".join(self.processes) or "none"


def load_tools(specs, timeout):
    """Each --tools file.py:fn or module:fn started in a process of its own and its schema read there, before any model
    loads: one sentence for a tool that cannot be loaded or described."""
    processes = {}
    for spec in specs:
        process = ToolProcess(spec)
        failed = process.start(timeout, None)
        if failed:
            raise SystemExit(failed[1])
        name = process.schema["function"]["name"]
        if name in processes:
            raise SystemExit(f"--tools {spec}: a tool named '{name}' is given twice; give each name once.")
        processes[name] = process
    return Tools(processes, [p.schema for p in processes.values()], timeout)


TOOL_CALL = re.compile(
    r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL
)  # Hermes' (Qwen's) form; unclosed at the end too


def parse_tool_calls(text, tokenizer):
    """The calls a policy's turn makes, each (name, arguments) or (None, why it could not be read): by the
    tokenizer's own parser where it has a response schema (transformers' parse_response), else in Hermes' form,
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Qwen's and many other templates write them."""
    if getattr(tokenizer, "response_schema", None):
        try:
            calls = [call.get("function", call) for call in tokenizer.parse_response(text).get("tool_calls") or []]
        except Exception as e:
            return [(None, f"the turn could not be parsed as the tokenizer's response schema says ({e})")]
        return [checked_call(call) for call in calls]
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            calls.append(checked_call(json.loads(body)))
        except json.JSONDecodeError as e:
            calls.append((None, f"the call {body.strip()!r} is not JSON ({e.msg})"))
    return calls


def checked_call(call):
    """(name, arguments) of a parsed call, or (None, why it is not a call: a name and a dict of arguments)."""
    arguments = call.get("arguments", {}) if isinstance(call, dict) else None
    if isinstance(arguments, str):  # OpenAI's form: the arguments as a JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
        return None, f'{json.dumps(call)} is not a call; write {{"name": "a tool", "arguments": {{...}}}}'
    return call["name"], arguments


def run_tool_calls(tools, calls):
    """Each call run in its tool's process, in order: the tool messages ({"role": "tool", "name", "content"}, the
    error as text where it failed) and how many calls were parsed, failed and timed out."""
    messages = []
    counts = dict(parsed=0, failed=0, timed_out=0)
    for name, arguments in calls:
        if name is None:  # not JSON, or not a call
            content = f"error: {arguments}"
        elif name not in tools.processes:
            content = f"error: there is no tool named {name!r}; the tools are {tools.names()}."
        else:
            kind, got = tools.processes[name].call(arguments, tools.timeout, tools.stops)
            content = got if kind == "result" else f"error: {got}"
            counts["timed_out"] += kind == "timeout"
            counts["failed"] += kind in ("raised", "stopped")  # wrong arguments, an exception, a crash
        counts["parsed"] += name is not None
        counts["failed"] += name is not None and name not in tools.processes
        messages.append({"role": "tool", "name": name or "unknown", "content": content})
    return messages, counts


def tool_message_ids(tokenizer, schemas, messages, turn_end):
    """The tokens the chat template writes after a policy's turn that ended with the text turn_end (its stop token):
    the tool messages and the opening of the next turn, as the template renders them after an assistant's turn. The
    policy's own tokens are never rendered again (no text is tokenised twice), so what it sampled is what trains."""
    mark = "\ue000"  # a private-use character: no template writes it
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}, *messages]
    text = tokenizer.apply_chat_template(chat, tools=schemas, add_generation_prompt=True, tokenize=False)
    after = text[text.rindex(mark) + len(mark) :].removeprefix(turn_end)
    return tokenizer(after, add_special_tokens=False)["input_ids"]


def assistant_message(text, calls):
    """A policy's turn as a message in TRL's form: its text, and its calls in OpenAI's form."""
    message = {"role": "assistant", "content": text}
    if calls:
        called = [c for c in calls if c[0] is not None]
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in called]
    return message

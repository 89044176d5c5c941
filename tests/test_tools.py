"""Tools (rlhf_runtime/tools.py, grpo_tools.py's --tools): the calls read from a policy's turn, in Hermes' form and by a
tokenizer's response schema; each tool run in a process of its own, as a reward function runs (its answer, its error
as text, a hang ended at --tool_timeout with everything it started, a crash that the next call survives, a stop); the
tools refused before any model loads; the tool messages rendered as the chat template writes them after a policy's
turn; and a reward in TRL's form given the conversation as messages. Each is compared with a hand-written
expectation."""

import os
import re
import signal
import threading
import time
import types

import pytest
from helpers import ROOT
from test_rewards import gone
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from rlhf_runtime.reward_process import call_in_form
from rlhf_runtime.tools import Tools, load_tools, parse_tool_calls, run_tool_calls, tool_message_ids

# ---------------------------------------------------------------- the calls read from a turn

NOT_A_CALL = 'is not a call; write {"name": "a tool", "arguments": {...}}'
PLAIN = types.SimpleNamespace()  # a tokenizer without a response schema: Hermes' form is read


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call>',
            [("multiply", {"a": 37, "b": 48})],
        ),
        (
            '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
            '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>',
            [("multiply", {"a": 2, "b": 3}), ("weather", {"city": "Paris"})],
        ),
        (
            'I cannot multiply these alone. <tool_call>\n{"name": "multiply", "arguments": {"a": 37, "b": 48}}\n'
            "</tool_call> Then I copy its answer.",
            [("multiply", {"a": 37, "b": 48})],
        ),
        (
            '<tool_call>{"name": "multiply", "arguments": {"a": 37,}}</tool_call>',
            [
                (
                    None,
                    """the call '{"name": "multiply", "arguments": {"a": 37,}}' is not JSON """
                    "(Expecting property name enclosed in double quotes)",
                )
            ],
        ),
        # the turn ended (its stop token) before the closing tag: a whole call is still read, a cut one is not JSON
        ('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}', [("multiply", {"a": 2, "b": 3})]),
        (
            '<tool_call>{"name": "multiply", "argu',
            [(None, """the call '{"name": "multiply", "argu' is not JSON (Unterminated string starting at)""")],
        ),
        ("<tool_call>[37, 48]</tool_call>", [(None, f"[37, 48] {NOT_A_CALL}")]),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', [(None, f'{{"arguments": {{"a": 1}}}} {NOT_A_CALL}')]),
        (
            '<tool_call>{"name": "multiply", "arguments": [37, 48]}</tool_call>',
            [(None, f'{{"name": "multiply", "arguments": [37, 48]}} {NOT_A_CALL}')],
        ),
        (  # OpenAI's form: the arguments as a JSON text
            '<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 37, \\"b\\": 48}"}</tool_call>',
            [("multiply", {"a": 37, "b": 48})],
        ),
        ("The answer is 1776.", []),
    ],
    ids=[
        "one",
        "two",
        "text_around",
        "broken_json",
        "unclosed_whole",
        "unclosed_cut",
        "a_list",
        "no_name",
        "arguments_a_list",
        "arguments_as_text",
        "none",
    ],
)
def test_calls_in_hermes_form_are_read_and_what_is_not_a_call_says_why(text, expected):
    assert parse_tool_calls(text, PLAIN) == expected


def test_calls_are_read_by_the_tokenizers_response_schema_where_it_has_one():
    """transformers' parse_response gives the message, its calls in OpenAI's form; one that raises is one failed call
    saying why (the stub stands for a tokenizer with a response_schema: what is tested is our reading of its output)."""
    answer = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    reads = types.SimpleNamespace(response_schema={"type": "object"}, parse_response=lambda text: answer)
    assert parse_tool_calls("whatever the template wrote", reads) == [("f", {"x": 1})]
    reads_none = types.SimpleNamespace(response_schema={"type": "object"}, parse_response=lambda text: {"content": ""})
    assert parse_tool_calls("no call", reads_none) == []

    def cannot_parse(text):
        raise ValueError("no match for the schema")

    raises = types.SimpleNamespace(response_schema={"type": "object"}, parse_response=cannot_parse)
    assert parse_tool_calls("<tool_call>{}", raises) == [
        (None, "the turn could not be parsed as the tokenizer's response schema says (no match for the schema)")
    ]


# ---------------------------------------------------------------- the tools run, each in a process of its own

TOOLS = '''
import asyncio
import os
import subprocess
import sys
import time

PIDS = {pids!r}  # where wait writes its process's id and its child's


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def city_population(city: str) -> int:
    """The population of a city.

    Args:
        city: the city's name
    """
    raise ValueError(f"no city named {{city}}")


def wait(seconds: float) -> str:
    """Start a program that runs for a minute, then wait.

    Args:
        seconds: how long to wait
    """
    child = subprocess.Popen(["sleep", "60"])
    with open(os.path.join(PIDS, "wait"), "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}")
    time.sleep(seconds)
    child.kill()
    child.wait()
    return "waited"


def weather(city: str) -> dict:
    """The weather in a city.

    Args:
        city: the city's name
    """
    return {{"city": city, "temperature": 21.5}}


async def add_later(a: int, b: int) -> int:
    """Add two whole numbers, awaiting first.

    Args:
        a: the first term
        b: the second term
    """
    await asyncio.sleep(0.01)
    return a + b


def leave(how: str) -> str:
    """End the process, or not.

    Args:
        how: "sys.exit", "os._exit", or anything else to stay
    """
    if how == "sys.exit":
        sys.exit(3)
    if how == "os._exit":
        os._exit(3)
    return "stayed"
'''
NAMES = ["multiply", "city_population", "wait", "weather", "add_later", "leave"]
TIMEOUT = 1.0  # --tool_timeout of the calls below


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """TOOLS written to a file, beside the folder where wait writes its ids."""
    folder = tmp_path_factory.mktemp("tools")
    (folder / "pids").mkdir()
    (folder / "tools.py").write_text(TOOLS.format(pids=str(folder / "pids")))
    return folder


@pytest.fixture(scope="module")
def tools(folder):
    """TOOLS loaded once (each process reads its schema, importing transformers: seconds), its calls bounded by
    TIMEOUT; every process killed at the end."""
    loaded = load_tools([f"{folder}/tools.py:{name}" for name in NAMES], TIMEOUT)
    yield loaded
    for process in loaded.processes.values():
        if process.process is not None:
            process.kill()


def wait_pids(folder):
    """The ids of the process that ran wait's last call and of the sleep it started, the file then removed (so that a
    call that never began leaves none)."""
    path = folder / "pids" / "wait"
    pids = [int(pid) for pid in path.read_text().split()]
    path.unlink()
    return pids


def test_each_tools_schema_is_read_from_its_type_hints_and_docstring(tools):
    assert list(tools.processes) == NAMES
    assert tools.schemas[0] == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two whole numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first factor"},
                    "b": {"type": "integer", "description": "the second factor"},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }
    assert [schema["function"]["name"] for schema in tools.schemas] == NAMES


def test_answers_and_errors_become_tool_messages_and_are_counted(tools):
    """An answer as text (a dict as JSON, an async def's awaited); an exception, a tool that does not exist and wrong
    arguments as an error message, each parsed and failed; a call that could not be read, neither."""
    unreadable = "the call '{' is not JSON (Expecting property name enclosed in double quotes)"
    calls = [
        ("multiply", {"a": 37, "b": 48}),
        ("city_population", {"city": "Atlantis"}),
        ("weather", {"city": "Paris"}),
        ("add_later", {"a": 2, "b": 3}),
        ("divide", {"a": 1, "b": 2}),
        ("multiply", {"a": 37}),
        ("multiply", {"a": 1, "b": 2, "c": 3}),
        (None, unreadable),
    ]
    messages, counts = run_tool_calls(tools, calls)
    assert messages == [
        {"role": "tool", "name": "multiply", "content": "1776"},
        {"role": "tool", "name": "city_population", "content": "error: ValueError: no city named Atlantis"},
        {"role": "tool", "name": "weather", "content": '{"city": "Paris", "temperature": 21.5}'},
        {"role": "tool", "name": "add_later", "content": "5"},
        {
            "role": "tool",
            "name": "divide",
            "content": "error: there is no tool named 'divide'; the tools are multiply, city_population, wait, "
            "weather, add_later, leave.",
        },
        {
            "role": "tool",
            "name": "multiply",
            "content": "error: TypeError: multiply() missing 1 required positional argument: 'b'",
        },
        {
            "role": "tool",
            "name": "multiply",
            "content": "error: TypeError: multiply() got an unexpected keyword argument 'c'",
        },
        {"role": "tool", "name": "unknown", "content": f"error: {unreadable}"},
    ]
    assert counts == {"parsed": 7, "failed": 4, "timed_out": 0}


def test_a_hung_call_ends_at_the_timeout_with_what_it_started_and_the_next_call_starts_it_again(tools, folder):
    started = time.time()
    messages, counts = run_tool_calls(tools, [("wait", {"seconds": 60})])
    assert time.time() - started < TIMEOUT + 5  # its timeout, and the kill; not the 60 s
    assert messages == [{"role": "tool", "name": "wait", "content": "error: no answer within --tool_timeout 1 s"}]
    assert counts == {"parsed": 1, "failed": 0, "timed_out": 1}
    hung = wait_pids(folder)
    assert tools.processes["wait"].process is None
    assert all(gone(pid) for pid in hung)  # the tool's process and the sleep it started
    messages, counts = run_tool_calls(tools, [("wait", {"seconds": 0})])
    assert messages == [{"role": "tool", "name": "wait", "content": "waited"}]
    assert counts == {"parsed": 1, "failed": 0, "timed_out": 0}
    assert wait_pids(folder)[0] != hung[0]  # a fresh process
    assert tools.schemas[2]["function"]["name"] == "wait"  # read once, kept


def test_sys_exit_is_the_calls_error_and_a_process_that_dies_is_started_again(tools):
    before = tools.processes["leave"].process.pid
    messages, counts = run_tool_calls(tools, [("leave", {"how": "sys.exit"})])
    assert messages[0]["content"] == "error: SystemExit: 3"
    assert counts == {"parsed": 1, "failed": 1, "timed_out": 0}
    assert tools.processes["leave"].process.pid == before  # caught in the process, which goes on
    messages, counts = run_tool_calls(tools, [("leave", {"how": "os._exit"}), ("leave", {"how": "stay"})])
    assert [m["content"] for m in messages] == ["error: the process running it ended (exit code 3)", "stayed"]
    assert counts == {"parsed": 2, "failed": 1, "timed_out": 0}
    assert tools.processes["leave"].process.pid != before
    assert not gone(tools.processes["leave"].process.pid, seconds=0)


def test_a_stop_signal_ends_a_tool_call_at_once_whatever_the_timeout(tools, folder):
    """SIGTERM (a signal in the run's stops) while a tool hangs under a 600 s timeout: the call is left within a second,
    its process and what it started killed; the calls after it in the turn do not begin."""
    stops = []
    stopping = Tools(tools.processes, tools.schemas, 600.0, stops)
    threading.Timer(1.0, stops.append, [signal.SIGTERM]).start()
    started = time.time()
    messages, counts = run_tool_calls(stopping, [("wait", {"seconds": 60}), ("multiply", {"a": 1, "b": 2})])
    assert time.time() - started < 1.0 + 3
    assert [m["name"] for m in messages] == ["wait", "multiply"]
    assert counts == {"parsed": 2, "failed": 2, "timed_out": 0}
    assert all(gone(pid) for pid in wait_pids(folder))
    assert tools.processes["wait"].process is None
    assert tools.processes["multiply"].process is not None  # never called: left as it was


# ---------------------------------------------------------------- the tools refused before any model loads

NO_HINTS = '''
def multiply(a, b):
    """Multiply.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b
'''
NO_ARGS_SECTION = '''
def multiply(a: int, b: int) -> int:
    """Multiply."""
    return a * b
'''
SCHEMA_ADVICE = (
    "give it type hints and a docstring with an Args: section naming each argument, as transformers' "
    "get_json_schema reads them."
)


@pytest.mark.parametrize(
    "specs, message",
    [
        (["{tmp}/missing.py:multiply"], r"'{tmp}/missing.py' could not be loaded \(FileNotFoundError: "),
        (["{tmp}/tools.py:divide"], r"'{tmp}/tools.py' has no function 'divide'; name one it defines\.$"),
        (
            ["{tmp}/no_hints.py:multiply"],
            r"its schema could not be read \(TypeHintParsingException: Argument a is missing a type hint in function "
            rf"multiply\); {re.escape(SCHEMA_ADVICE)}$",
        ),
        (
            ["{tmp}/no_args_section.py:multiply"],
            r"its schema could not be read \(DocstringParsingException: Cannot generate JSON schema for multiply "
            rf"because the docstring has no description for the argument 'a'\); {re.escape(SCHEMA_ADVICE)}$",
        ),
        (
            ["{root}/assets/tools.py:multiply", "{tmp}/tools.py:multiply"],
            r"a tool named 'multiply' is given twice; give each name once\.$",
        ),
    ],
    ids=["missing_file", "missing_function", "no_type_hints", "no_args_section", "a_name_twice"],
)
def test_a_tool_that_cannot_be_loaded_or_described_is_refused_in_one_sentence_naming_it(specs, message, tmp_path):
    (tmp_path / "tools.py").write_text(open(os.path.join(ROOT, "assets", "tools.py")).read())  # a copy: its multiply
    (tmp_path / "no_hints.py").write_text(NO_HINTS)
    (tmp_path / "no_args_section.py").write_text(NO_ARGS_SECTION)
    specs = [spec.format(tmp=tmp_path, root=ROOT) for spec in specs]
    with pytest.raises(SystemExit) as refused:
        load_tools(specs, 30)
    sentence = refused.value.code
    assert sentence.startswith(f"--tools {specs[-1]}: ")  # the spec refused: the last given
    assert re.search(message.format(tmp=re.escape(str(tmp_path))), sentence), sentence


def test_a_short_tool_timeout_does_not_refuse_a_tool_at_loading(tmp_path):
    """--tool_timeout 1 bounds each call, but loading the shipped multiply also reads its schema, which imports
    transformers in the tool's process (2 to 5 s): a good tool must not be refused as an import that hangs."""
    tools = load_tools([f"{ROOT}/assets/tools.py:multiply"], TIMEOUT)
    try:
        assert run_tool_calls(tools, [("multiply", {"a": 37, "b": 48})])[0][0]["content"] == "1776"
    finally:
        tools.processes["multiply"].kill()


# ---------------------------------------------------------------- the tool messages, as the chat template writes them

TINY_TOOLS = os.path.join(ROOT, "assets", "tiny-tools")
ANSWER = [{"role": "tool", "name": "multiply", "content": "1776"}]


@pytest.mark.skipif(not os.path.isdir(TINY_TOOLS), reason="assets/tiny-tools is not built (assets/build.py builds it)")
def test_the_tiny_tools_template_writes_the_tool_response_alone_after_the_policys_end_of_turn():
    """Its template has no generation prompt: after the turn's "<|endoftext|>", the tool's answer in its tags."""
    import assets.tools

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOOLS)
    ids = tool_message_ids(tokenizer, [get_json_schema(assets.tools.multiply)], ANSWER, "<|endoftext|>")
    assert tokenizer.decode(ids) == "<tool_response>1776</tool_response>"
    assert ids == tokenizer("<tool_response>1776</tool_response>", add_special_tokens=False)["input_ids"]
    tags = tokenizer.convert_tokens_to_ids(["<tool_response>", "</tool_response>"])
    assert [ids[0], ids[-1]] == tags  # each tag one token


# A template of Qwen2.5's form, written here: every message opens with <|im_start|>role and ends with <|im_end|>; the
# tool messages after a turn share one user message, each answer in <tool_response> tags on lines of its own.
QWEN_STYLE = (
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_qwen_style_template_writes_the_tool_messages_and_the_next_turns_opening():
    """After a turn ending with "<|im_end|>": the rest of its line, the tool messages in one user message and the
    generation prompt; the policy's own turn is not in the ids."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "tiny-sft"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN_STYLE
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tool_message_ids(tokenizer, [], ANSWER, "<|im_end|>")
    expected = "\n<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == expected
    assert [i for i in ids if i in (start, end)] == [start, end, start]  # each marker one token
    two = [*ANSWER, {"role": "tool", "name": "weather", "content": "error: ValueError: no city"}]
    ids = tool_message_ids(tokenizer, [], two, "<|im_end|>")
    assert tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n1776\n</tool_response>\n<tool_response>\nerror: ValueError: no city\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


# ---------------------------------------------------------------- a reward in TRL's form reads the conversation


def completions_received(prompts, completions, **kwargs):
    """A reward in TRL's form that gives back the completions it was called with."""
    return completions


def test_a_trl_reward_gets_each_conversation_as_messages_and_a_plain_response_as_before():
    conversation = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 48}}}],
        },
        {"role": "tool", "name": "multiply", "content": "1776"},
        {"role": "assistant", "content": "1776"},
    ]
    batch = dict(  # score_responses' keys
        responses=["<tool_call>...</tool_call><tool_response>1776</tool_response>1776", "1700"],
        answers=["1776", "1776"],
        prompts=["37*48=", "37*48="],
        prompt_texts=["37*48=", "37*48="],
        queries=["37*48=...1776", "37*48=1700"],
        completion_ids=[[5, 6, 7], [8]],
        columns=[{"answer": "1776"}, {"answer": "1776"}],
        completion_messages=[conversation, [{"role": "assistant", "content": "1700"}]],
        step=0,
        max_steps=2,
    )
    assert call_in_form(completions_received, "TRL's", batch) == (batch["completion_messages"], {})
    texts = batch["responses"]
    for without in (None, "absent"):
        plain = {**batch, "completion_messages": None}
        if without == "absent":
            del plain["completion_messages"]
        assert call_in_form(completions_received, "TRL's", plain) == (texts, {})
        chat = {**plain, "prompts": [[{"role": "user", "content": "37*48="}]] * 2}
        as_turns = [[{"role": "assistant", "content": text}] for text in texts]
        assert call_in_form(completions_received, "TRL's", chat) == (as_turns, {})

"""The tool and the reward of the embedded default's tool task (``assets/multiply/``, policy ``assets/tiny-tools/``).

The policy is asked for products like ``"37*48="`` that it cannot compute alone; given the ``multiply`` tool it can
call it (``<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call>``), read the result in a
``<tool_response>`` and copy it as its answer. ``final_answer`` scores only that last turn.

Both are examples to read: a tool is a plain typed function whose docstring has an ``Args:`` section, which is what
``transformers.utils.get_json_schema`` turns into the JSON schema a chat template renders; a reward takes lists
(the decoded responses and the rows' answers) and returns a float per response.
"""


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def final_answer(responses, answers):
    """1.0 where the policy's last turn, stripped, is exactly the answer, else 0.0.

    The last turn is the text after the last "</tool_response>", or the whole response when no tool answered: a
    response that ends in a tool call nobody answered scores 0.
    """
    scores = []
    for response, answer in zip(responses, answers):
        last_turn = response.rpartition("</tool_response>")[2]
        scores.append(float(last_turn.strip() == str(answer)))
    return scores

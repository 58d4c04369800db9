r"""The built-in reward functions (fntrain.rewards): final answers found as math and GSM8K graders find them
(the last balanced \boxed{}, else after the last "####", else the last number), numbers in the forms
people and models write them, reference answers that cannot be scored giving None, and the format reward
wanting exactly one final answer at the end. Standard library only, so a user can copy the module."""

from __future__ import annotations

import ast
import doctest
import sys
from pathlib import Path

import pytest

import fntrain.rewards
from fntrain.rewards import (
    answer_format,
    answer_value,
    completion_text,
    final_number,
    math_accuracy,
    parse_number,
)

NUMBERS = [
    ("42", 42.0), ("-7", -7.0), ("+3", 3.0), ("3.25", 3.25), (".5", 0.5), ("-0.5", -0.5),
    ("1,234", 1234.0), ("1,234,567.89", 1234567.89), ("3/4", 0.75), ("-3/4", -0.75),
    ("42.", 42.0), ("$18", 18.0), ("-$5", -5.0), ("$-5", -5.0), ("\\$1,000", 1000.0), ("50%", 50.0),
    ("50\\%", 50.0), ("\\frac{3}{4}", 0.75), ("\\dfrac{1}{3}", 1 / 3), ("-\\frac{3}{4}", -0.75),
    ("\\frac{-3}{4}", -0.75), ("\u22127", -7.0), ("  12  ", 12.0), ("1{,}234", 1234.0), ("90^\\circ", 90.0),
    ("x^2", None), ("", None), ("abc", None), ("1/0", None), ("12,34", None), ("1,2345", None),
    ("3 + 4", None), ("2x", None), ("4.5.6", None),
]  # fmt: skip


@pytest.mark.parametrize(("text", "value"), NUMBERS)
def test_parse_number_reads_one_number_and_nothing_else(text, value):
    assert parse_number(text) == pytest.approx(value) if value is not None else parse_number(text) is None


FINAL = [
    ("so the answer is \\boxed{42}.", 42.0),
    ("\\boxed{1} first, then \\boxed{2}", 2.0),                          # the last box
    ("\\boxed{\\frac{3}{4}}", 0.75),                                      # braces inside the box balance
    ("\\boxed {7}", 7.0),
    ("first \\boxed{4} then \\boxed{5", 4.0),                             # an unclosed box is not an answer
    ("\\boxed{x = 5}", 5.0), ("\\boxed{5 \\text{ cm}}", 5.0), ("\\boxed{5 \\text{cm}^2}", 5.0), ("\\boxed{12kg}", 12.0), ("\\boxed{\\text{42}}", 42.0),
    ("\\boxed{2^{10}}", None), ("\\boxed{3x}", None), ("\\boxed{1, 2}", None),  # an expression states no number
    ("\\boxed{72} #### 71", 72.0),                                        # a box wins over ####
    ("Step: 48/2 = 24\n#### 72", 72.0), ("#### 1,234", 1234.0), ("#### $-3.50", -3.5),
    ("#### The answer is 42.", 42.0), ("#### 72\n\nI hope this helps (2 steps).", 72.0), ("#### 3 and 4", None),
    ("It costs $18.", 18.0), ("3 + 4 = 7", 7.0), ("x=-5", -5.0), ("答案是42", 42.0), ("The 3rd is 1/2", 0.5),
    ("version v1.2", None), ("x^2", None), ("no number here", None), ("", None),
]  # fmt: skip


@pytest.mark.parametrize(("text", "value"), FINAL)
def test_final_number(text, value):
    assert final_number(text) == pytest.approx(value) if value is not None else final_number(text) is None


ANSWERS = [
    (72, 72.0), (0.5, 0.5), (-3, -3.0), ("72", 72.0), ("1,234", 1234.0), ("\\frac{1}{3}", 1 / 3),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 72.0), ("\\boxed{5}", 5.0), ("42.", 42.0),
    (True, None), (float("nan"), None), (float("inf"), None), (None, None), ([72], None), ("", None),
    ("x^2 + 1", None), ("The answer is 42", None),  # a plain string must be one number: no guessing
]  # fmt: skip


@pytest.mark.parametrize(("answer", "value"), ANSWERS)
def test_answer_value(answer, value):
    assert answer_value(answer) == pytest.approx(value) if value is not None else answer_value(answer) is None


def test_math_accuracy_scores_each_completion_against_its_rows_answer():
    completions = [
        "48/2 = 24, 48 + 24 = 72. \\boxed{72}",  # right
        "#### 72.0",  # right, as a decimal
        "so 71",  # wrong
        "I cannot tell.",  # no answer: wrong, not unscored
        "\\boxed{0.30000000000000004}",  # equal within the relative tolerance
        "\\boxed{1,000,002}",  # off by two in a million: outside 1e-6
        "\\boxed{1/3}",
        "\\boxed{42}",  # the row's answer holds no number: not scored
    ]
    answers = ["#### 72", 72, "72", 72, 0.3, 1_000_000, "\\frac{1}{3}", "x^2"]
    prompts = ["p"] * len(completions)
    rewards = math_accuracy(prompts=prompts, completions=completions, completion_ids=[[1]] * 8, answer=answers,
                            trainer_state=None, log_extra=None, log_metric=None, other_column=[0] * 8)  # fmt: skip
    assert rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, None]


def test_math_accuracy_reads_chat_completions():
    chat = [[{"role": "assistant", "content": "It is \\boxed{5}."}], [{"role": "assistant", "content": "It is 6"}]]
    assert math_accuracy(chat, answer=[5, 5]) == [1.0, 0.0]
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "x"}]}]) == "a"
    with pytest.raises(TypeError, match="a completion must be a string or a list of messages, got int"):
        math_accuracy([3], answer=[3])


FORMATS = [
    ("So \\boxed{72}.", 1.0), ("$\\boxed{72}$.", 1.0), ("\\[ \\boxed{72} \\]", 1.0), ("\\boxed{\\frac{1}{2}}\n", 1.0),
    ("48/2 = 24\n#### 72", 1.0), ("#### $1,234.\n", 1.0), ("  #### 72", 1.0),
    ("\\boxed{72} because 72 is right", 0.0),    # text after the box
    ("\\boxed{1} or \\boxed{2}", 0.0),           # two answers
    ("\\boxed{72}\n#### 72", 0.0),               # two answers of two kinds
    ("#### 72\nDone.", 0.0), ("Answer: #### 72", 0.0), ("#### abc", 0.0), ("####", 0.0),
    ("\\boxed{}", 0.0), ("\\boxed{72", 0.0), ("The answer is 72.", 0.0), ("", 0.0),
]  # fmt: skip


@pytest.mark.parametrize(("completion", "reward"), FORMATS)
def test_answer_format(completion, reward):
    assert answer_format([completion]) == [reward]
    assert answer_format(completions=[[{"role": "assistant", "content": completion}]], answer=[1]) == [reward]


def test_docstring_examples_hold():
    assert doctest.testmod(fntrain.rewards).failed == 0


def test_standard_library_only():
    tree = ast.parse(Path(fntrain.rewards.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    outside = {name for name in imported if name.split(".")[0] not in sys.stdlib_module_names | {"__future__"}}
    assert not outside

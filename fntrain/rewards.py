r"""Reward functions for GRPO, to name on the command line as module:function:

    fntrain run grpo ... --grpo.reward-funcs fntrain.rewards:math_accuracy fntrain.rewards:answer_format \
        --grpo.reward-weights 1.0 0.2

Each follows TRL's convention, so a function written for `trl.GRPOTrainer` works here and these work there:
it is called once per batch of completions with the keywords `prompts`, `completions`, `completion_ids`,
every other column of the prompt rows as a list (one item per completion: `answer=[...]`), `trainer_state`,
`log_extra` and `log_metric`, and returns one float per completion, or None for a completion it cannot
score (NaN in the rewards, as TRL keeps it). A completion is its text, or after a chat prompt its
messages: [{"role": "assistant", "content": text}].

Final answers are numbers, found the way math and GSM8K graders look for them: the last `\boxed{...}`
(braces balanced), else what follows the last "####", else the last number of the text. A number may be
negative, a decimal, written with thousands separators ("1,234"), a fraction ("3/4", "\frac{3}{4}"), with a
"$" or "%" sign, units ("5 cm") or a trailing period. Standard library only: copy this module to start
reward functions of one's own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "math_accuracy",
    "answer_format",
    "completion_text",
    "parse_number",
    "final_number",
    "answer_value",
    "RELATIVE_TOLERANCE",
]

RELATIVE_TOLERANCE = 1e-6
"""math_accuracy's tolerance: 0.1 + 0.2 and 0.3 are the same answer."""

_NUMBER = (
    r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"  # 1,234.5 | 12.5 | .5
    r"(?:/\d+(?:\.\d+)?)?"  # a fraction's denominator: 3/4
)
_WHOLE_NUMBER = re.compile(_NUMBER)
_NUMBER_IN_TEXT = re.compile(r"(?<![A-Za-z0-9_.^])" + _NUMBER)  # not the 2 of "x2", "x^2" nor "v1.2"
_UNIT = re.compile(  # "5 cm", "12kg", "5 m^2"; not "3x" (a variable)
    r"^\s*(" + _NUMBER + r")(?:\s+(?=[A-Za-z])|(?=[A-Za-z]{2}))[A-Za-z][A-Za-z\s.]*(?:\^\s*\{?\d+\}?)?\s*$"
)
_LATEX_WORDS = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_SPACES = re.compile(r"\\[,;:! ]|\\left|\\right|\^\s*\{?\\circ\}?|°")
_BOXED = "\\boxed"


# ----------------------------------------------------------------------------- reading a completion


def completion_text(completion: Any) -> str:
    """The text of a completion: itself when a string, else the contents of its messages joined by
    newlines (a chat completion, [{"role": "assistant", "content": ...}])."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and all(isinstance(m, Mapping) for m in completion):
        return "\n".join(_content_text(message.get("content")) for message in completion)
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # content blocks: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    raise TypeError(f"a message's content must be a string or a list of parts, got {type(content).__name__}")


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start of `\boxed`, end after its closing brace) of each `\boxed{...}` whose braces balance."""
    spans, start = [], text.find(_BOXED)
    while start >= 0:
        position = start + len(_BOXED)
        while position < len(text) and text[position] == " ":
            position += 1
        if position < len(text) and text[position] == "{":
            depth = 0
            for end in range(position, len(text)):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth == 0:
                    spans.append((start, end + 1))
                    break
        start = text.find(_BOXED, start + 1)
    return spans


def _boxed_content(text: str, span: tuple[int, int]) -> str:
    opening = text.index("{", span[0])
    return text[opening + 1 : span[1] - 1]


def _normalize(text: str) -> str:
    """LaTeX and typography that only dresses a number: `\frac{a}{b}` -> a/b, `\text{cm}` -> cm, signs
    ($, %, degrees), spacing commands, the Unicode minus."""
    text = text.replace("\u2212", "-").replace("{,}", ",")
    text = _LATEX_WORDS.sub(r" \1 ", text)
    text = _LATEX_FRACTION.sub(r"(\1)/(\2)", text)
    text = re.sub(r"\((-?[\d.]+)\)/\((\d[\d.]*)\)", r"\1/\2", text)  # (3)/(4) -> 3/4; other fractions stay
    text = _LATEX_SPACES.sub("", text)
    return text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")


def _value(number: str) -> float | None:
    """The value of a `_NUMBER` match (None for a zero denominator)."""
    numerator, _, denominator = number.replace(",", "").partition("/")
    value = Fraction(numerator)
    if denominator:
        if Fraction(denominator) == 0:
            return None
        value /= Fraction(denominator)
    return float(value)


def parse_number(text: str) -> float | None:
    """The value of a text that is one number and nothing else (after `_normalize`, around whitespace
    and a trailing period): parse_number("$1,234.") == 1234.0, parse_number("\\frac{3}{4}") == 0.75,
    parse_number("-3/4") == -0.75; parse_number("x^2") is None."""
    candidate = _normalize(text).strip().rstrip(".").strip()
    match = _WHOLE_NUMBER.fullmatch(candidate)
    return _value(match.group()) if match else None


def _segment_number(segment: str, *, only_number: bool) -> float | None:
    """The number a final-answer segment (a box's content, a "####" line) states: after its last "=",
    one number; else a number followed by units ("5 cm"); else, with `only_number`, the only number in
    it ("The answer is 42"). A box holding an expression ("2^{10}", "3x") states no number."""
    segment = _normalize(segment)
    value = parse_number(segment.rpartition("=")[2])
    if value is not None:
        return value
    unit = _UNIT.match(segment.rstrip().rstrip("."))
    if unit:
        return _value(unit.group(1))
    numbers = _NUMBER_IN_TEXT.findall(segment) if only_number else []
    return _value(numbers[0]) if len(numbers) == 1 else None


def _after_marker(text: str) -> str:
    """The first non-empty line after the last "####"."""
    lines = [line for line in text.rpartition("####")[2].splitlines() if line.strip()]
    return lines[0] if lines else ""


def final_number(text: str) -> float | None:
    r"""The final answer of a completion as a number: the last balanced `\boxed{...}`, else the first
    non-empty line after the last "####", else the last number of the text; None when there is none (or
    the box or "####" line states no single number). final_number("so \boxed{42}.") == 42.0,
    final_number("#### 1,234") == 1234.0, final_number("It costs $18.") == 18.0."""
    spans = _boxed_spans(text)
    if spans:
        return _segment_number(_boxed_content(text, spans[-1]), only_number=False)
    if "####" in text:
        return _segment_number(_after_marker(text), only_number=True)
    numbers = _NUMBER_IN_TEXT.findall(_normalize(text))
    return _value(numbers[-1]) if numbers else None


def answer_value(answer: Any) -> float | None:
    r"""The number a reference answer holds: an int or float itself (not a bool, NaN or infinity); a
    string with a `\boxed{...}` or a "####" (GSM8K: "...#### 72") as `final_number` reads it; any other
    string must be one number (`parse_number`). None when it holds no number (the row cannot be scored)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return float(answer) if math.isfinite(answer) else None
    if not isinstance(answer, str):
        return None
    if _boxed_spans(answer) or "####" in answer:
        return final_number(answer)
    return parse_number(answer)


# ----------------------------------------------------------------------------- reward functions


def math_accuracy(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float | None]:
    r"""1.0 for each completion whose final answer (`final_number`) equals the row's `answer` column
    (`answer_value`: a number, or a string such as GSM8K's "... #### 72") within a relative tolerance of
    1e-6; 0.0 when it differs or the completion states no answer; None when the row's answer holds no
    number (that completion is not scored).

        >>> math_accuracy(["... so \\boxed{72}.", "#### 71", "no idea"], answer=["#### 72", 71, "x^2"])
        [1.0, 1.0, None]
    """
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = answer_value(reference)
        if expected is None:
            rewards.append(None)
            continue
        got = final_number(completion_text(completion))
        rewards.append(float(got is not None and math.isclose(got, expected, rel_tol=RELATIVE_TOLERANCE)))
    return rewards


def _ends_with_one_answer(text: str) -> bool:
    if text.count(_BOXED) + text.count("####") != 1:
        return False
    if _BOXED in text:  # only closing punctuation may follow the box: "$\boxed{42}$." or "\[ \boxed{42} \]"
        spans = _boxed_spans(text)
        return (
            bool(spans)
            and bool(_boxed_content(text, spans[0]).strip())
            and re.fullmatch(r"[\s.$)\]\\]*", text[spans[0][1] :]) is not None
        )
    before, _, after = text.partition("####")
    opens_line = not before.rpartition("\n")[2].strip()
    return opens_line and "\n" not in after.strip() and parse_number(after) is not None


def answer_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    r"""1.0 for each completion that ends with its final answer stated once, as a `\boxed{...}` (only
    closing punctuation after it) or as a last line "#### <number>"; 0.0 otherwise (no answer, two of
    them, or text after it). A small weight beside `math_accuracy` teaches the format early.

        >>> answer_format(["So \\boxed{72}.", "#### 72", "\\boxed{1} or \\boxed{2}", "#### 72\nDone."])
        [1.0, 1.0, 0.0, 0.0]
    """
    return [float(_ends_with_one_answer(completion_text(completion))) for completion in completions]

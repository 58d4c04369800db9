"""Reward functions named module:function (fntrain.step.objectives.grpo.rewards): loading errors name the
flag and the spec as typed, a module beside the data imports from the working directory, functions are
called with exactly TRL 1.16's keywords, and every way a function can fail is one line naming it and the
completion. A TRL reward function drops in unchanged."""

from __future__ import annotations

import asyncio
import math
import os
import sys

import numpy as np
import pytest
import torch

from fntrain.step.objectives.grpo.rewards import (
    RewardError,
    RewardFunction,
    load_reward_functions,
    score_completions,
)

KEYWORDS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}


def where(i: int) -> str:
    return f"data.path 'p.jsonl' line {i // 2 + 1}, completion {i % 2 + 1} of 2"


def reward_batch(count: int = 4) -> dict:
    """`count` completions, two per prompt, with an answer and a level column."""
    return {
        "prompts": [f"prompt {i // 2}" for i in range(count)],
        "completions": [f"completion {i}" for i in range(count)],
        "completion_ids": [[i, i + 1] for i in range(count)],
        "columns": {"answer": [str(i // 2) for i in range(count)], "level": [i // 2 for i in range(count)]},
    }


def score(*fns, count: int = 4, **kwargs) -> torch.Tensor:
    functions = [RewardFunction(f"my_rewards:{fn.__name__}", fn.__name__, fn) for fn in fns]
    return score_completions(functions, **reward_batch(count), where=where, **kwargs)


def error_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- loading


def test_builtins_load_with_their_names():
    functions = load_reward_functions(["fntrain.rewards:math_accuracy", "fntrain.rewards:answer_format"])
    assert [(f.spec, f.name) for f in functions] == [
        ("fntrain.rewards:math_accuracy", "math_accuracy"),
        ("fntrain.rewards:answer_format", "answer_format"),
    ]
    from fntrain.rewards import math_accuracy

    assert functions[0].fn is math_accuracy


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["my_rewards_nowhere:acc"], "grpo.reward_funcs[0] 'my_rewards_nowhere:acc': module 'my_rewards_nowhere' "
                                     "cannot be imported (No module named 'my_rewards_nowhere')"),
        (["fntrain.rewards:math_accuracy", "fntrain.rewards:accuracy"],
         "grpo.reward_funcs[1] 'fntrain.rewards:accuracy': module 'fntrain.rewards' has no 'accuracy' "
         "(its functions: answer_format, answer_value, completion_text, final_number, math_accuracy, parse_number)"),
        (["fntrain.rewards:RELATIVE_TOLERANCE"],
         "grpo.reward_funcs[0] 'fntrain.rewards:RELATIVE_TOLERANCE': 'RELATIVE_TOLERANCE' is float, not a function"),
        (["fntrain.rewards:math_accuracy", "fntrain.rewards:math_accuracy"],
         "grpo.reward_funcs[1] 'fntrain.rewards:math_accuracy': its name 'math_accuracy' is also that of "
         "grpo.reward_funcs[0] 'fntrain.rewards:math_accuracy', so their metrics (rewards/math_accuracy/mean) "
         "would collide: wrap one in a function of another name"),
        (["fntrain.rewards.math_accuracy"],
         "grpo.reward_funcs[0] 'fntrain.rewards.math_accuracy' must be module:function, got "
         "'fntrain.rewards.math_accuracy'"),
    ],
)  # fmt: skip
def test_loading_errors_name_the_flag_and_the_spec(specs, message):
    with pytest.raises(ValueError) as error:
        load_reward_functions(specs)
    assert error_line(error) == message


def test_a_module_beside_the_data_imports_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_here.py").write_text(
        "def accuracy(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    (tmp_path / "other_rewards_here.py").write_text("from my_rewards_here import accuracy\n")
    (tmp_path / "broken_rewards_here.py").write_text("raise RuntimeError('needs a GPU\\nand more')\n")
    monkeypatch.chdir(tmp_path)
    here = os.path.abspath(os.curdir)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != here])
    for name in ("my_rewards_here", "other_rewards_here", "broken_rewards_here"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (function,) = load_reward_functions(["my_rewards_here:accuracy"], "rewards")
    assert function.name == "accuracy" and sys.path[-1] == here  # last: it shadows no installed module
    with pytest.raises(ValueError) as error:  # the same name through another module: their metrics collide
        load_reward_functions(["my_rewards_here:accuracy", "other_rewards_here:accuracy"])
    assert "its name 'accuracy' is also that of grpo.reward_funcs[0]" in error_line(error)
    with pytest.raises(ValueError) as error:
        load_reward_functions(["broken_rewards_here:accuracy"])
    assert error_line(error) == ("grpo.reward_funcs[0] 'broken_rewards_here:accuracy': module 'broken_rewards_here' "
                               "cannot be imported (RuntimeError: needs a GPU)")  # fmt: skip


# ----------------------------------------------------------------------------- calling


def test_functions_get_trls_keywords_and_columns_as_lists():
    seen = []

    def recorder(**kwargs):
        seen.append(kwargs)
        kwargs["log_metric"]("my_metric", 0.5)
        kwargs["log_extra"]("my_column", ["a"] * 4)
        return [0.0, 1, True, None]

    metrics, extra = [], []
    rewards = score(recorder, trainer_state="state", log_metric=lambda *a: metrics.append(a),
                    log_extra=lambda *a: extra.append(a))  # fmt: skip
    assert rewards.dtype == torch.float32 and rewards.shape == (4, 1)
    assert rewards[:3, 0].tolist() == [0.0, 1.0, 1.0] and math.isnan(rewards[3, 0])
    (kwargs,) = seen
    assert set(kwargs) == KEYWORDS | {"answer", "level"}
    expected = reward_batch()
    assert kwargs["prompts"] == expected["prompts"] and kwargs["completions"] == expected["completions"]
    assert kwargs["completion_ids"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert kwargs["answer"] == ["0", "0", "1", "1"] and kwargs["level"] == [0, 0, 1, 1]
    assert all(type(kwargs[key]) is list for key in ("prompts", "completions", "completion_ids", "answer"))
    assert kwargs["trainer_state"] == "state"
    assert metrics == [("my_metric", 0.5)] and extra == [("my_column", ["a"] * 4)]


def test_several_functions_fill_their_columns_and_logging_defaults_to_nothing():
    def first(completions, log_metric, log_extra, **kwargs):
        log_metric("x", 1.0)  # no-ops by default
        log_extra("y", [1])
        return [1.0, 2.0, 3.0, 4.0]

    def array(completions, **kwargs):
        return np.array([0.5, -1.0, 0.0, 2.0], dtype=np.float32)

    def tensor(completions, **kwargs):
        return torch.tensor([1, 0, 1, 0])

    async def later(completions, **kwargs):
        await asyncio.sleep(0)
        return [np.float64(0.25), np.bool_(True), 7, None]

    rewards = score(first, array, tensor, later)
    assert rewards[:, :3].tolist() == [[1.0, 0.5, 1.0], [2.0, -1.0, 0.0], [3.0, 0.0, 1.0], [4.0, 2.0, 0.0]]
    assert rewards[:3, 3].tolist() == [0.25, 1.0, 7.0] and math.isnan(rewards[3, 3])
    assert score(first, count=0).shape == (0, 1)


# ----------------------------------------------------------------------------- failures


def test_a_function_that_raises_is_named_with_the_first_completion_it_raises_on():
    def picky(completions, answer, **kwargs):
        return [1.0 / (int(text.split()[-1]) - 2) for text in completions]  # completion 2 divides by zero

    with pytest.raises(RewardError) as error:
        score(picky)
    assert error_line(error) == ("reward function 'my_rewards:picky' raised on data.path 'p.jsonl' line 2, "
                               "completion 1 of 2: ZeroDivisionError: float division by zero")  # fmt: skip
    assert isinstance(error.value.__cause__, ZeroDivisionError)


def test_a_function_that_needs_a_missing_column_is_named_on_the_first_completion():
    def needs_solution(completions, solution, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"^reward function 'my_rewards:needs_solution' raised on data.path "
                       r"'p.jsonl' line 1, completion 1 of 2: TypeError: .*'solution'$"):  # fmt: skip
        score(needs_solution)


def test_a_function_that_fails_only_on_the_whole_batch_names_the_batch():
    def small_batches_only(completions, **kwargs):
        if len(completions) > 1:
            raise MemoryError("too many at once\nsecond line")
        return [1.0]

    with pytest.raises(RewardError) as error:
        score(small_batches_only)
    assert error_line(error) == (
        "reward function 'my_rewards:small_batches_only' raised on the 4 completions data.path 'p.jsonl' line 1, "
        "completion 1 of 2 to data.path 'p.jsonl' line 2, completion 2 of 2, though on none of them alone: "
        "MemoryError: too many at once"
    )


def test_the_row_by_row_search_logs_nothing():
    logged = []

    def logs_then_fails(completions, log_metric, **kwargs):
        log_metric("calls", 1.0)
        raise ValueError("no")

    with pytest.raises(RewardError, match="line 1, completion 1 of 2: ValueError: no"):
        score(logs_then_fails, log_metric=lambda *a: logged.append(a))
    assert logged == [("calls", 1.0)]  # the batch call's only


BAD_RESULTS = [
    ([1.0, 2.0, 3.0], "returned 3 rewards for 4 completions (the 4 completions data.path 'p.jsonl' line 1, "
                      "completion 1 of 2 to data.path 'p.jsonl' line 2, completion 2 of 2): one per completion, "
                      "None where it cannot score one"),
    ([1.0, "high", 0.0, 1.0], "returned 'high' (str) for data.path 'p.jsonl' line 1, completion 2 of 2: a reward "
                              "is a float, an int, a bool or None"),
    ([1.0, 0.0, [1.0] * 40, 1.0], "returned [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1... (list) "
                                  "for data.path 'p.jsonl' line 2, completion 1 of 2"),
    ([1.0, 0.0, 1.0, float("nan")], "returned nan for data.path 'p.jsonl' line 2, completion 2 of 2: rewards must "
                                    "be finite (return None for a completion it cannot score)"),
    ([float("-inf"), 0.0, 1.0, 1.0], "returned -inf for data.path 'p.jsonl' line 1, completion 1 of 2"),
    (0.5, "returned 0.5 for the 4 completions data.path 'p.jsonl' line 1, completion 1 of 2 to data.path "
          "'p.jsonl' line 2, completion 2 of 2: expected a list of 4 rewards"),
    ("1111", "returned '1111' for the 4 completions"),
    ({"a": 1.0}, "returned {'a': 1.0} for the 4 completions"),
    (None, "returned None for the 4 completions"),
]  # fmt: skip


@pytest.mark.parametrize(("result", "message"), BAD_RESULTS)
def test_a_bad_result_is_one_line_naming_the_function_and_the_completion(result, message):
    def bad(completions, **kwargs):
        return result

    with pytest.raises(RewardError) as error:
        score(bad)
    assert error_line(error).startswith("reward function 'my_rewards:bad' " + message)


def test_columns_are_checked():
    functions = load_reward_functions(["fntrain.rewards:answer_format"])
    with pytest.raises(ValueError, match="column 'log_metric' would collide with the keyword log_metric="):
        score_completions(functions, ["p"], ["c"], [[1]], {"log_metric": [1]}, where=where)
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 1 completions"):
        score_completions(functions, ["p"], ["c"], [[1]], {"answer": [1, 2]}, where=where)
    with pytest.raises(ValueError, match="got 2 prompts, 1 id lists and 1 completions"):
        score_completions(functions, ["p", "q"], ["c"], [[1]], {}, where=where)


# ----------------------------------------------------------------------------- TRL's and fntrain's own


def test_trl_and_builtin_reward_functions_drop_in():
    functions = load_reward_functions(
        ["trl.rewards:think_format_reward", "fntrain.rewards:math_accuracy", "fntrain.rewards:answer_format"]
    )
    assert [f.name for f in functions] == ["think_format_reward", "math_accuracy", "answer_format"]
    texts = ["<think>\n2 + 2\n</think>\nIt is \\boxed{4}.", "It is 5.", "<think>hmm</think>\n#### 4", "no"]
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    prompts = [[{"role": "user", "content": "2 + 2?"}]] * 4
    rewards = score_completions(functions, prompts, completions, [[1, 2]] * 4, {"answer": ["#### 4"] * 3 + ["x"]},
                                where=where, trainer_state=object())  # fmt: skip
    assert rewards[:3].tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert rewards[3, 0] == 0.0 and math.isnan(rewards[3, 1]) and rewards[3, 2] == 0.0

import pytest

from arborl.tasks.calculator import (
    CalculatorError,
    evaluate,
    extract_answer,
    make_tasks,
    run_tool,
    score,
)


def test_evaluate_arithmetic_only():
    assert evaluate("(12 + 7) * 3") == 57
    assert evaluate("-4 / 2") == -2
    for bad in ["__import__('os')", "2 ** 10", "a + 1", "1 if 1 else 2", "[1]", "True + 1"]:
        with pytest.raises(CalculatorError):
            evaluate(bad)
    with pytest.raises(CalculatorError, match="division by zero"):
        evaluate("1/0")


def test_run_tool_returns_errors_as_text():
    assert run_tool('{"expression": "6*7"}') == "42"
    assert run_tool({"expression": "7/2"}) == "3.5"
    assert run_tool("{not json").startswith("error:")
    assert run_tool({"expr": "1"}).startswith("error:")
    assert run_tool({"expression": 5}).startswith("error:")


def test_tasks_are_deterministic_and_splits_disjoint():
    a, b = make_tasks("train", 60, seed=3), make_tasks("train", 60, seed=3)
    assert [t.prompt for t in a] == [t.prompt for t in b]
    ev = make_tasks("eval", 60, seed=3)
    # disjoint seeds: an identical question can only come up by chance (~1 in thousands per pair)
    assert len({t.prompt for t in a} & {t.prompt for t in ev}) <= 2
    assert {t.metadata["level"] for t in a} == {1, 2, 3}
    for t in a:
        assert str(t.metadata["answer"]).lstrip("-").isdigit()
    with pytest.raises(ValueError):
        make_tasks("test", 3)


def test_answers_are_extracted_and_scored():
    t = make_tasks("eval", 1)[0]
    ans = t.metadata["answer"]
    assert score(t, f"thinking... Answer: {ans}") == 1.0
    assert score(t, f"Answer: {int(ans) + 1}") == 0.0
    assert score(t, ans) == 0.0  # the format is part of the task
    assert extract_answer("Answer: 1,234") == "1234"
    assert extract_answer("Answer: 3.50") == "3.5"
    assert extract_answer("no answer") is None

"""Problem statements from a task's facts (``meta``), in a few phrasings (the reword perturbation picks
another). Easy names the file, function and failing tests; medium the entry point and failing tests;
hard only the symptom."""

from __future__ import annotations

from typing import Any

PHRASINGS = 3


def render(meta: dict[str, Any]) -> str:
    """The statement of a task (``meta['phrasing']`` picks the wording)."""
    symptom = meta["symptom"].replace("$f", meta["function"])
    tests = ", ".join(f"`{t}`" for t in meta["failing_tests"])
    p = meta.get("phrasing", 0) % PHRASINGS
    tier = meta["tier"]
    if tier == "easy":
        where = f"`{meta['function']}` in `{meta['bug_file']}`"
        head = [f"Fix the bug in {where}.", f"There is a bug in the function {where}; repair it.",
                f"{where} does not do what its docstring says. Make it correct."][p]
        return f"{head}\n\n{symptom}\n\nHidden tests that fail now: {tests}. Change only what the fix needs."
    if tier == "medium":
        entry = f"`{meta['entry']}` (defined in `{meta['entry_file']}`)"
        head = [f"The public function {entry} misbehaves.", f"A user reports a problem with {entry}.",
                f"{entry} returns wrong results for some inputs."][p]
        return (f"{head}\n\n{symptom}\n\nHidden tests that fail now: {tests}. The fault may lie in any module of "
                "the package; fix the cause, not the symptom.")
    head = ["Bug report:", "A user writes:", "Observed behaviour:"][p]
    return f"{head} {symptom}\n\nFind the cause in this repository and fix it."

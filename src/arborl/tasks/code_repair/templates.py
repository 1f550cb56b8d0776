"""The bug templates: a correct function, the one edit that injects the bug, and hidden tests.

A template is a function ``(rng) -> Bug``. Its code uses ``$f`` for the function's name; the tests'
expected values are computed by running the *fixed* code at generation time (``generate.py``), so a
template states inputs, never answers. ``bug`` is ``(fixed fragment, buggy fragment)``: the fragment
must occur exactly once in the fixed code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from arborl.registry import Registry


@dataclass(frozen=True)
class Check:
    """One hidden test: ``assert $f(args) == <expected>`` (``raises`` set: the call must raise it), or
    ``body``, a test body of its own (``$f`` is the function)."""

    name: str
    args: str = ""
    raises: str | None = None
    body: str | None = None


@dataclass(frozen=True)
class Bug:
    kind: str  # the template's name
    names: tuple[str, ...]  # candidate function names (one is drawn)
    code: str  # the fixed function (``$f``), no imports beyond the standard library
    bug: tuple[str, str]  # (fragment of the fixed code, what the buggy code has instead)
    checks: list[Check]
    symptom: str  # what a user sees, no code location (``$f`` allowed)
    helpers: str = ""  # extra top-level definitions of the same module (not buggy)
    imports: list[str] = field(default_factory=list)


Template = Callable[[random.Random], Bug]
BUG_TEMPLATES: Registry[Template] = Registry("bug template")


def _ints(rng: random.Random, n: int, lo: int = 1, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


@BUG_TEMPLATES.register("off_by_one")
def _off_by_one(rng: random.Random) -> Bug:
    xs, k = _ints(rng, rng.randint(5, 8)), rng.randint(2, 3)
    return Bug(
        "off_by_one", ("window_sums", "rolling_totals", "sliding_sums", "moving_totals"),
        '''def $f(values, size):
    """Sums of every window of `size` consecutive values, in order."""
    if size <= 0:
        raise ValueError("size must be positive")
    return [sum(values[i:i + size]) for i in range(len(values) - size + 1)]
''',
        ("range(len(values) - size + 1)", "range(len(values) - size)"),
        [Check("test_windows", f"{xs}, {k}"), Check("test_one_window", f"{xs[:k]}, {k}"),
         Check("test_window_longer_than_values", f"{xs[:2]}, 5"), Check("test_bad_size", "[1, 2], 0", raises="ValueError")],
        f"`$f({xs}, {k})` misses the last window: the result is one element short.",
    )


@BUG_TEMPLATES.register("wrong_comparison")
def _wrong_comparison(rng: random.Random) -> Bug:
    t = rng.randint(5, 15)
    xs = _ints(rng, 6, 1, 25) + [t, t]
    rng.shuffle(xs)
    below = [x for x in _ints(rng, 5, 1, 25) if x != t]
    return Bug(
        "wrong_comparison", ("count_at_least", "num_reaching", "count_meeting_quota", "tally_qualified"),
        '''def $f(scores, threshold):
    """How many scores reach the threshold (a score equal to it counts)."""
    return sum(1 for s in scores if s >= threshold)
''',
        ("s >= threshold", "s > threshold"),
        [Check("test_counts_equal_scores", f"{xs}, {t}"), Check("test_no_equal_scores", f"{below}, {t}"),
         Check("test_empty", f"[], {t}"), Check("test_only_threshold", f"[{t}], {t}")],
        f"`$f({xs}, {t})` does not count the scores equal to {t}.",
    )


@BUG_TEMPLATES.register("inverted_condition")
def _inverted_condition(rng: random.Random) -> Bug:
    xs = [rng.randint(-9, 9) or 1 for _ in range(7)]
    xs[0], xs[1] = -abs(xs[0]), abs(xs[1])
    return Bug(
        "inverted_condition", ("keep_positive", "positive_only", "drop_non_positive", "select_gains"),
        '''def $f(values):
    """The values greater than zero, in their original order."""
    kept = []
    for v in values:
        if v > 0:
            kept.append(v)
    return kept
''',
        ("if v > 0:", "if not v > 0:"),
        [Check("test_mixed", f"{xs}"), Check("test_empty", "[]"), Check("test_all_negative", "[-3, -1]"),
         Check("test_returns_list", body="    assert isinstance($f([]), list)\n")],
        f"`$f({xs})` returns exactly the values it should have dropped.",
    )


@BUG_TEMPLATES.register("missing_empty_case")
def _missing_empty(rng: random.Random) -> Bug:
    xs = _ints(rng, rng.randint(3, 6))
    return Bug(
        "missing_empty_case", ("mean_value", "average_of", "arithmetic_mean", "mean_score"),
        '''def $f(values):
    """The mean of the values; 0.0 for no values."""
    if not values:
        return 0.0
    return sum(values) / len(values)
''',
        ("    if not values:\n        return 0.0\n", ""),
        [Check("test_empty_is_zero", "[]"), Check("test_mean", f"{xs}"), Check("test_single", f"[{xs[0]}]")],
        "`$f([])` raises ZeroDivisionError instead of returning 0.0.",
    )


@BUG_TEMPLATES.register("missing_zero_case")
def _missing_zero(rng: random.Random) -> Bug:
    a, b = rng.randint(10, 50), rng.randint(51, 99)
    return Bug(
        "missing_zero_case", ("percent_change", "relative_growth", "growth_percent", "change_ratio"),
        '''def $f(old, new):
    """Percent change from old to new, rounded to 2 places; None when old is zero (undefined)."""
    if old == 0:
        return None
    return round((new - old) / old * 100, 2)
''',
        ("    if old == 0:\n        return None\n", ""),
        [Check("test_growth", f"{a}, {b}"), Check("test_drop", f"{b}, {a}"), Check("test_from_zero", f"0, {b}")],
        f"`$f(0, {b})` crashes with ZeroDivisionError; it should say the change is undefined (None).",
    )


@BUG_TEMPLATES.register("missing_negative_case")
def _missing_negative(rng: random.Random) -> Bug:
    n = rng.randint(100, 99999)
    return Bug(
        "missing_negative_case", ("digit_list", "digits_of", "split_digits", "decimal_digits"),
        '''def $f(number):
    """The decimal digits of an integer, most significant first (the sign is ignored)."""
    number = abs(number)
    return [int(c) for c in str(number)]
''',
        ("    number = abs(number)\n", ""),
        [Check("test_positive", f"{n}"), Check("test_zero", "0"), Check("test_negative", f"-{n}")],
        f"`$f(-{n})` raises ValueError; negative numbers should give the digits of their absolute value.",
    )


@BUG_TEMPLATES.register("wrong_default")
def _wrong_default(rng: random.Random) -> Bug:
    n, per = rng.randint(12, 30), rng.choice([3, 4, 5])
    return Bug(
        "wrong_default", ("page_of", "paginate", "get_page", "slice_page"),
        '''def $f(items, page=1, per_page=''' + str(per) + '''):
    """Page `page` (1 = the first) of `items`, `per_page` items per page."""
    start = (page - 1) * per_page
    return items[start:start + per_page]
''',
        ("page=1,", "page=0,"),
        [Check("test_default_is_first_page", f"list(range({n}))"), Check("test_second_page", f"list(range({n})), 2"),
         Check("test_explicit_first_page", f"list(range({n})), page=1")],
        "Calling `$f(items)` without a page returns an empty list instead of the first page.",
    )


@BUG_TEMPLATES.register("wrong_return_value")
def _wrong_return(rng: random.Random) -> Bug:
    xs = rng.sample(range(10, 60), 6)
    missing = next(v for v in range(60, 99) if v not in xs)
    return Bug(
        "wrong_return_value", ("index_of", "find_position", "locate_item", "position_of"),
        '''def $f(items, target):
    """Index of the first item equal to target, or -1 when there is none."""
    for i, item in enumerate(items):
        if item == target:
            return i
    return -1
''',
        ("    return -1\n", "    return 0\n"),
        [Check("test_found", f"{xs}, {xs[3]}"), Check("test_first", f"{xs}, {xs[0]}"), Check("test_missing", f"{xs}, {missing}"),
         Check("test_empty", f"[], {missing}")],
        f"`$f({xs}, {missing})` says the item is at index 0 although it is not in the list.",
    )


@BUG_TEMPLATES.register("mutable_default")
def _mutable_default(rng: random.Random) -> Bug:
    a, b = rng.sample(["red", "blue", "green", "urgent", "draft", "final", "old"], 2)
    return Bug(
        "mutable_default", ("add_tag", "with_label", "append_tag", "tag_list"),
        '''def $f(tag, tags=None):
    """`tags` (a new list when not given) with `tag` appended; returns the list."""
    if tags is None:
        tags = []
    tags.append(tag)
    return tags
''',
        ("tags=None", "tags=[]"),
        [Check("test_fresh_list_each_call", body=f"    $f({a!r})\n    assert $f({b!r}) == [{b!r}]\n"),
         Check("test_given_list", f"{b!r}, [{a!r}]"), Check("test_single", f"{a!r}")],
        f"Calling `$f({b!r})` after an earlier `$f({a!r})` returns both tags: calls leak into each other.",
    )


@BUG_TEMPLATES.register("str_bytes")
def _str_bytes(rng: random.Random) -> Bug:
    word = rng.choice(["hello", "arborl", "sandbox", "payload", "packet", "frame"]) + str(rng.randint(0, 99))
    return Bug(
        "str_bytes", ("checksum8", "byte_checksum", "simple_checksum", "sum_bytes"),
        '''def $f(data):
    """Sum of the bytes of `data` modulo 256; a str is encoded as UTF-8 first."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return sum(data) % 256
''',
        ('data = data.encode("utf-8")', "data = data"),
        [Check("test_bytes", f"{word.encode()!r}"), Check("test_str", f"{word!r}"),
         Check("test_str_equals_bytes", body=f"    assert $f({word!r}) == $f({word.encode()!r})\n"), Check("test_empty", "b''")],
        f"`$f({word!r})` raises TypeError, while the same text as bytes works.",
    )


@BUG_TEMPLATES.register("int_division")
def _int_division(rng: random.Random) -> Bug:
    xs = _ints(rng, 3, 1, 5)
    if sum(xs) % 3 == 0:
        xs[0] += 1
    return Bug(
        "int_division", ("average_rating", "mean_rating", "rating_average", "avg_stars"),
        '''def $f(ratings):
    """The average of the ratings as a float."""
    return sum(ratings) / len(ratings)
''',
        ("sum(ratings) / len(ratings)", "sum(ratings) // len(ratings)"),
        [Check("test_fractional", f"{xs}"), Check("test_whole", "[4, 4]"), Check("test_is_float", body="    assert isinstance($f([1, 2]), float)\n")],
        f"`$f({xs})` loses the fraction: the average is rounded down to a whole number.",
    )


@BUG_TEMPLATES.register("wrong_loop_bound")
def _wrong_loop_bound(rng: random.Random) -> Bug:
    xs = _ints(rng, rng.randint(4, 7), 0, 50)
    return Bug(
        "wrong_loop_bound", ("pairwise_deltas", "step_differences", "successive_diffs", "deltas_of"),
        '''def $f(values):
    """Differences between each value and the one before it (len(values) - 1 of them)."""
    out = []
    for i in range(1, len(values)):
        out.append(values[i] - values[i - 1])
    return out
''',
        ("range(1, len(values))", "range(1, len(values) - 1)"),
        [Check("test_deltas", f"{xs}"), Check("test_two_values", f"{xs[:2]}"), Check("test_single", f"[{xs[0]}]"), Check("test_empty", "[]")],
        f"`$f({xs})` drops the last difference.",
    )


@BUG_TEMPLATES.register("swapped_arguments")
def _swapped(rng: random.Random) -> Bug:
    xs = _ints(rng, 4, 1, 9)
    return Bug(
        "swapped_arguments", ("percent_shares", "share_of_total", "percentages_of", "proportions"),
        '''def $f(values):
    """Each value as a percentage of the total, rounded to 2 places."""
    total = sum(values)
    return [round(_ratio(v, total) * 100, 2) for v in values]
''',
        ("_ratio(v, total)", "_ratio(total, v)"),
        [Check("test_shares", f"{xs}"), Check("test_single_is_100", f"[{xs[0]}]"), Check("test_empty", "[]")],
        f"`$f({xs})` gives shares above 100 percent.",
        helpers='''def _ratio(part, whole):
    """part / whole as a float."""
    return part / whole
''',
    )


@BUG_TEMPLATES.register("wrong_dict_key")
def _wrong_key(rng: random.Random) -> Bug:
    orders = [{"qty": rng.randint(1, 5), "amount": rng.randint(10, 99)} for _ in range(3)]
    return Bug(
        "wrong_dict_key", ("order_total", "total_amount", "sum_orders", "revenue_of"),
        '''def $f(orders):
    """The sum of the orders' "amount" fields."""
    return sum(order["amount"] for order in orders)
''',
        ('order["amount"]', 'order["qty"]'),
        [Check("test_total", f"{orders}"), Check("test_empty", "[]"), Check("test_single", f"[{orders[0]}]")],
        f"`$f({orders})` returns a number far smaller than the sum of the amounts.",
    )


@BUG_TEMPLATES.register("missing_return")
def _missing_return(rng: random.Random) -> Bug:
    name = rng.choice(["  ada   lovelace ", "grace  hopper", " alan turing  ", "  edsger dijkstra"])
    return Bug(
        "missing_return", ("clean_name", "normalize_name", "tidy_name", "canonical_name"),
        '''def $f(name):
    """`name` with runs of whitespace collapsed and each word capitalised; "" for an empty name."""
    if not name:
        return ""
    cleaned = " ".join(name.split()).title()
    return cleaned
''',
        ("    return cleaned\n", ""),
        [Check("test_cleans", f"{name!r}"), Check("test_empty", "''"), Check("test_simple", "'bob'")],
        f"`$f({name!r})` returns None.",
    )


@BUG_TEMPLATES.register("wrong_string_method")
def _wrong_string_method(rng: random.Random) -> Bug:
    title = rng.choice(["Hello World", "Agentic RL Now", "Sandbox Escape", "Gold Patch"]) + "  "
    return Bug(
        "wrong_string_method", ("slugify", "make_slug", "url_slug", "title_slug"),
        '''def $f(title):
    """A URL slug: surrounding whitespace removed, lower case, words joined by "-"."""
    return "-".join(title.strip().lower().split(" "))
''',
        ("title.strip()", "title.lstrip()"),
        [Check("test_trailing_space", f"{title!r}"), Check("test_plain", f"{title.strip()!r}"), Check("test_leading_space", f"'  {title.strip()}'")],
        f"`$f({title!r})` ends in dashes.",
    )


@BUG_TEMPLATES.register("shadowed_variable")
def _shadowed(rng: random.Random) -> Bug:
    t = rng.randint(20, 40)
    grid = [[rng.choice([t, 7, 8]) for _ in range(3)] for _ in range(3)]
    grid[1][1] = t
    return Bug(
        "shadowed_variable", ("rows_with", "count_by_row", "locate_rows", "row_hits"),
        '''def $f(grid, target):
    """(row index, how many cells equal target) for each row holding target."""
    hits = []
    for i, row in enumerate(grid):
        count = 0
        for value in row:
            if value == target:
                count += 1
        if count:
            hits.append((i, count))
    return hits
''',
        ("for value in row:\n            if value == target:", "for i in row:\n            if i == target:"),
        [Check("test_hits", f"{grid}, {t}"), Check("test_no_hits", f"{grid}, 99"), Check("test_empty", f"[], {t}")],
        f"`$f({grid}, {t})` reports wrong row numbers.",
    )


@BUG_TEMPLATES.register("early_return_in_loop")
def _early_return(rng: random.Random) -> Bug:
    xs = _ints(rng, 4, 1, 9) + [-rng.randint(1, 9)]
    return Bug(
        "early_return_in_loop", ("all_positive", "every_positive", "only_positive", "positive_all"),
        '''def $f(values):
    """True when every value is greater than zero (True for no values)."""
    for v in values:
        if v <= 0:
            return False
    return True
''',
        ("            return False\n    return True\n", "            return False\n        return True\n    return True\n"),
        [Check("test_late_negative", f"{xs}"), Check("test_all_positive", f"{xs[:4]}"), Check("test_empty", "[]"),
         Check("test_first_negative", f"{xs[::-1]}")],
        f"`$f({xs})` is True although the list holds a negative value.",
    )


@BUG_TEMPLATES.register("sort_order_reversed")
def _sort_order(rng: random.Random) -> Bug:
    xs, k = rng.sample(range(1, 100), 7), rng.randint(2, 4)
    return Bug(
        "sort_order_reversed", ("top_scores", "best_k", "highest_values", "leaders"),
        '''def $f(scores, k):
    """The k highest scores, highest first."""
    return sorted(scores, reverse=True)[:k]
''',
        ("sorted(scores, reverse=True)", "sorted(scores)"),
        [Check("test_top", f"{xs}, {k}"), Check("test_zero", f"{xs}, 0"), Check("test_single", f"[{xs[0]}], 1")],
        f"`$f({xs}, {k})` returns the lowest scores.",
    )


@BUG_TEMPLATES.register("wrong_index")
def _wrong_index(rng: random.Random) -> Bug:
    evs = rng.sample(["login", "logout", "click", "view", "error", "retry", "save"], 4)
    return Bug(
        "wrong_index", ("latest_event", "last_event", "most_recent", "newest_entry"),
        '''def $f(events):
    """The most recent event (the list is oldest first); None when there are none."""
    if not events:
        return None
    return events[-1]
''',
        ("events[-1]", "events[0]"),
        [Check("test_latest", f"{evs}"), Check("test_single", f"[{evs[0]!r}]"), Check("test_empty", "[]")],
        f"`$f({evs})` returns the oldest event instead of the newest.",
    )


@BUG_TEMPLATES.register("exception_not_raised")
def _exception_not_raised(rng: random.Random) -> Bug:
    good, bad = rng.randint(1024, 9000), rng.choice([0, 70000, 65536, 99999])
    return Bug(
        "exception_not_raised", ("parse_port", "port_number", "read_port", "to_port"),
        '''def $f(text):
    """The TCP port in `text`; ValueError unless it is an integer in 1..65535."""
    port = int(text)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range: {port}")
    return port
''',
        ('        raise ValueError(f"port out of range: {port}")\n', "        pass\n"),
        [Check("test_valid", f"'{good}'"), Check("test_out_of_range", f"'{bad}'", raises="ValueError"),
         Check("test_not_a_number", "'http'", raises="ValueError")],
        f"`$f('{bad}')` returns {bad} instead of rejecting the out-of-range port.",
    )


@BUG_TEMPLATES.register("wrong_accumulator_init")
def _wrong_init(rng: random.Random) -> Bug:
    xs = _ints(rng, 4, 2, 6)
    return Bug(
        "wrong_accumulator_init", ("product_of", "multiply_all", "total_product", "prod_values"),
        '''def $f(values):
    """The product of the values (1 for no values)."""
    result = 1
    for v in values:
        result *= v
    return result
''',
        ("    result = 1\n", "    result = 0\n"),
        [Check("test_product", f"{xs}"), Check("test_empty_is_one", "[]"), Check("test_with_zero", f"[{xs[0]}, 0]")],
        f"`$f({xs})` is always 0.",
    )


@BUG_TEMPLATES.register("wrong_boolean_operator")
def _wrong_bool(rng: random.Random) -> Bug:
    lo, hi = rng.randint(0, 10), rng.randint(20, 30)
    return Bug(
        "wrong_boolean_operator", ("in_range", "within_bounds", "is_between", "bounded"),
        '''def $f(x, low, high):
    """True when low <= x <= high."""
    return low <= x and x <= high
''',
        ("low <= x and x <= high", "low <= x or x <= high"),
        [Check("test_inside", f"{(lo + hi) // 2}, {lo}, {hi}"), Check("test_above", f"{hi + 5}, {lo}, {hi}"),
         Check("test_below", f"{lo - 5}, {lo}, {hi}"), Check("test_edges", body=f"    assert $f({lo}, {lo}, {hi}) and $f({hi}, {lo}, {hi})\n")],
        f"`$f({hi + 5}, {lo}, {hi})` is True although {hi + 5} is above {hi}.",
    )


@BUG_TEMPLATES.register("wrong_arithmetic_operator")
def _wrong_arith(rng: random.Random) -> Bug:
    price, qty, disc = rng.randint(5, 50), rng.randint(2, 9), rng.choice([5, 10, 20])
    return Bug(
        "wrong_arithmetic_operator", ("line_total", "order_line_cost", "discounted_total", "cost_of_line"),
        '''def $f(price, quantity, discount=0):
    """price * quantity minus `discount` percent, rounded to 2 places."""
    return round(price * quantity * (1 - discount / 100), 2)
''',
        ("(1 - discount / 100)", "(1 + discount / 100)"),
        [Check("test_discount", f"{price}, {qty}, {disc}"), Check("test_no_discount", f"{price}, {qty}"),
         Check("test_full_discount", f"{price}, {qty}, 100")],
        f"`$f({price}, {qty}, {disc})` is more than the undiscounted total.",
    )


@BUG_TEMPLATES.register("wrong_slice_step")
def _wrong_slice(rng: random.Random) -> Bug:
    word = rng.choice(["stressed", "drawer", "arborl", "sandbox", "gateway"])
    return Bug(
        "wrong_slice_step", ("reverse_words", "flip_words", "mirror_words", "backwards_words"),
        '''def $f(sentence):
    """Each word of the sentence reversed, the word order kept."""
    return " ".join(word[::-1] for word in sentence.split())
''',
        ("word[::-1]", "word[::1]"),
        [Check("test_reverse", f"'{word} {word[::-1]}x'"), Check("test_palindrome", "'level noon'"), Check("test_empty", "''")],
        f"`$f('{word}')` returns the word unchanged.",
    )

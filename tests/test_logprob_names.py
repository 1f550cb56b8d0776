"""The sampled token's log-prob has one name on each side of the data pool (docs/glossary.md, "Terms"):
``logprobs`` from the engine to the data pool, ``rollout_logprobs`` as the trainer's behaviour log-prob.
In train/ a variable or keyword argument that carries the behaviour log-probs unchanged (the value
itself, detached, masked, moved, gathered per token) is named ``rollout_logprobs``, or ``old_logprobs``
where it is one choice of the ratio's pi_old; a name such as ``rollout`` or ``old`` for it fails here.
Values computed from it (a log-ratio, a chunk mean) are other values and keep their own names."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "src" / "arborl" / "train"

NAME = "rollout_logprobs"
SOURCES = {NAME, "behaviour_logprobs"}  # the field, and the Sample method that picks it (or sample_logprobs)
ALIASES = {"behaviour_logprobs", "behavior_logprobs", "behav_logprobs", "behaviour_logp", "behav_logp"}  # as parameters
KEEPS_VALUE = {"detach", "to", "float", "double", "clone", "contiguous", "cpu", "cuda", "tolist",  # methods
               "where", "_per_token", "pad_sequence", "tensor", "as_tensor", "list", "tuple"}  # functions


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def carries(node: ast.AST | None) -> bool:
    """Whether ``node`` evaluates to the behaviour log-probs, unchanged in value."""
    if isinstance(node, ast.Name):
        return node.id in SOURCES
    if isinstance(node, ast.Attribute):
        return node.attr in SOURCES
    if isinstance(node, ast.Lambda):
        return carries(node.body)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr in SOURCES:
            return True  # s.behaviour_logprobs(tempered)
        if _callee(node) not in KEEPS_VALUE:
            return False
        receiver = [node.func.value] if isinstance(node.func, ast.Attribute) else []
        strings = [a for a in node.args if isinstance(a, ast.Constant) and a.value in SOURCES]  # _per_token(mb, "...")
        return bool(strings) or any(carries(a) for a in [*receiver, *node.args, *(k.value for k in node.keywords)])
    return False


def third_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each binding or keyword argument that gives the behaviour log-probs another name."""
    bad = []
    for node in ast.walk(tree):
        pairs: list[tuple[str, ast.AST, set[str]]] = []  # (name, value, names allowed)
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    pairs.append((t.id, node.value, {NAME}))
                elif isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
                    pairs += [(e.id, v, {NAME}) for e, v in zip(t.elts, node.value.elts) if isinstance(e, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name):
            pairs.append((node.target.id, node.value, {NAME}))
        elif isinstance(node, ast.keyword) and node.arg is not None:
            pairs.append((node.arg, node.value, {NAME}))
        elif isinstance(node, ast.arg) and node.arg in ALIASES:
            bad.append((node.lineno, node.arg))
        for name, value, allowed in pairs:
            if isinstance(value, ast.IfExp) and (carries(value.body) or carries(value.orelse)):
                if name not in allowed | {"old_logprobs"}:  # pi_old: the trainer's own or the rollout's
                    bad.append((node.lineno, name))
            elif carries(value) and name not in allowed:
                bad.append((node.lineno, name))
    return bad


def test_the_behaviour_logprobs_have_one_name_in_train():
    found = [f"{f.name}:{line}: {name}" for f in sorted(TRAIN.rglob("*.py"))
             for line, name in third_names(ast.parse(f.read_text(), str(f)))]
    assert not found, f"name these rollout_logprobs (or old_logprobs for pi_old): {found}"


def test_the_check_catches_a_third_name():
    code = """
def step(mb, prox, m, cfg, tempered):
    rollout = _per_token(mb, lambda s: s.behaviour_logprobs(tempered), dtype, device)
    behav = torch.where(m, rollout_logprobs.detach(), 0.0)
    old = prox if cfg.old_logprobs == "trainer" else rollout_logprobs
    rollout_logprobs = torch.where(m, rollout_logprobs.to(dtype), 0.0)
    old_logprobs = prox if cfg.old_logprobs == "trainer" else rollout_logprobs
    log_ratio = torch.where(m, logp - rollout_logprobs, 0.0)
    decoupled_weights(prox, behaviour_logprobs=rollout_logprobs)
    policy_loss(cfg, logp, old_logprobs, rollout_logprobs=rollout_logprobs)

def weights(proximal_logprobs, behaviour_logprobs, mask):
    return proximal_logprobs - behaviour_logprobs
"""
    found = sorted(third_names(ast.parse(code)))
    assert [name for _, name in found] == ["rollout", "behav", "old", "behaviour_logprobs", "behaviour_logprobs"]

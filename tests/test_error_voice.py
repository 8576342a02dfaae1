"""Every error a user can cause speaks in one voice.

A message names where the problem is (the schedule path, or the file / flag / function when there is no
schedule path), the offending value, and what would be valid::

    layers.0.linear1: cannot shard 'weight' (shape (128, 32)) along axis 5: valid axes are 0, 1

The first half of this file reads the package source with ``ast``: every ``raise X(...)`` of a
``SchedlangError`` subclass must build its message so that it starts with a location (a placeholder such
as ``{where}``, ``{path}``, ``{sch.path}``, or a literal name without spaces, then ``": "``; or a
``--flag`` first) and holds a hint of what is valid. The second half feeds bad inputs to primitives and
checks the messages users actually see.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import schedlang.errors

PACKAGE = Path(schedlang.errors.__file__).resolve().parent

#: words that tell the reader what would be valid, or what to do instead
HINT_WORDS = (
    "valid", "expect", "must", "one of", "use ", "use:", "pass ", "need", "known", "available", "should",
    "give ", "set ", "install", "try ", "did you mean", "only", "support", "allowed", "require", "call ",
    "instead", "either", "add ", "remove", "choose", "at least", "at most", "divisible", "match",
    "not both", "rerun", "re-run", "check ", "keep ", "move ", "cut ", "create ", "name them", "fix ",
    "mark ", "e.g.", "such as", " are ", "are:", "registered", "give", "run ", "wrap ", "define ", "make ",
    "start ", "see ", "consider", "raise ", "lower ", "increase", "reduce ", "drop ", "change ", "rename",
    "provide", "register", "import ", "upgrade",
)

#: raises whose message cannot follow the rule where they are written: (file relative to the package,
#: function name) -> reason. Keep this short; a new entry needs a reason a reviewer would accept.
ALLOWLIST: dict[tuple[str, str], str] = {
    ("graph/pattern.py", "trace_pattern"): "find() re-raises it behind the schedule path ('<root>: cannot trace ...')",
    ("optim/base.py", "_check_hyperparameters"): "torch.optim's wording ('Invalid learning rate: ...'), kept so code "
                                                 "that matches torch's errors keeps working; '{where}' names the group",
    ("optim/adam.py", "_check_group"): "torch.optim's wording, as above",
    ("optim/sgd.py", "_check_group"): "torch.optim's wording, as above",
    ("train/flags.py", "_fail"): "raises the message its callers build; RAISE_HELPERS checks each call",
    ("distributed/agreement.py", "exchange"): "re-raises the failures the ranks collected, one 'rank N: ...' line each",
    ("distributed/agreement.py", "check_same_plan"): "joins one 'rank N: ...' line per rank that disagrees",
    ("verify/core.py", "_finish"): "the report of every mismatch, one line each, each naming the tensor and the bound",
}

#: raises that name where and what is wrong but not yet what would be valid. The list only shrinks:
#: a test fails once an entry conforms, so that it is taken off.
HINT_PENDING: set[tuple[str, str]] = set()

#: functions that raise their argument as the named error; their call sites are checked as raises
#: (folder, function name) -> error
RAISE_HELPERS = {("train/", "_fail"): "TrainError"}

#: files whose raises are owned elsewhere and reported there
ALLOWLIST_FILES: dict[str, str] = {
}


# --------------------------------------------------------------------------------------------- static


def _error_class_names() -> set[str]:
    """Names of SchedlangError and every subclass, in errors.py or defined anywhere in the package."""
    names = {name for name, obj in vars(schedlang.errors).items()
             if inspect.isclass(obj) and issubclass(obj, schedlang.errors.SchedlangError)}
    classes = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                classes.append((node.name, [_last_name(b) for b in node.bases]))
    changed = True
    while changed:
        changed = False
        for name, bases in classes:
            if name not in names and any(b in names for b in bases):
                names.add(name)
                changed = True
    return names


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


@dataclass
class Raise:
    file: str
    line: int
    function: str
    error: str
    message: ast.AST | None
    source: str


def _raises(error_names: set[str]) -> list[Raise]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for func in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            for node in _own_nodes(func):
                helper = next((e for (folder, name), e in RAISE_HELPERS.items()
                               if rel.startswith(folder) and isinstance(node, ast.Call)
                               and _last_name(node.func) == name), None)
                if helper:
                    call, error = node, helper
                elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                        _last_name(node.exc.func) in error_names:
                    call, error = node.exc, _last_name(node.exc.func)
                else:
                    continue
                message = call.args[0] if call.args else None
                message = _resolve(message, func, node.lineno)
                found.append(Raise(rel, node.lineno, getattr(func, "name", "<module>"), error, message,
                                   ast.unparse(call)))
    return found


def _own_nodes(func: ast.AST):
    """Nodes of ``func``'s body, not descending into nested functions (they are visited on their own)."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _resolve(message, func, line):
    """A message held in a local variable: the last assignment to it before the raise (``+=`` appends)."""
    if not isinstance(message, ast.Name):
        return message
    value = None
    for node in sorted((n for n in _own_nodes(func) if getattr(n, "lineno", line) < line),
                       key=lambda n: n.lineno):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == message.id
                                                for t in node.targets):
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                node.target.id == message.id and node.value is not None:
            value = node.value
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and \
                node.target.id == message.id and value is not None:
            value = ast.BinOp(value, ast.Add(), node.value)
    return value if value is not None else message


#: a message flattened into pieces: str for literal text, ast.AST for a placeholder
def _pieces(node) -> list | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                out.append(value.value)
            else:
                out.append(value.value)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pieces(node.left), _pieces(node.right)
        if left is None:
            return None
        return left + (right if right is not None else [node.right])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
        return _split_template(node.left.value, r"%[sdrif]")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format" and \
            isinstance(node.func.value, ast.Constant):
        return _split_template(node.func.value.value, r"\{[^{}]*\}")
    if isinstance(node, ast.IfExp):  # both branches must speak; check the first, the second is checked below
        return _pieces(node.body)
    return None


def _split_template(text: str, placeholder: str) -> list:
    out, last = [], 0
    for match in re.finditer(placeholder, text):
        out += [text[last:match.start()], ast.Name(id=match.group(0))]
        last = match.end()
    return out + [text[last:]]


LOCATION_LITERAL = re.compile(r"^[^\s:]+: ")
FLAG_FIRST = re.compile(r"^--[a-z][\w-]*[ =:,]")


def _problems(message) -> list[str]:
    pieces = _pieces(message)
    if pieces is None:
        return [f"message is not built from literal text ({ast.unparse(message) if message else 'no message'})"]
    pieces = [p for p in pieces if p != ""]
    problems = []
    if not _starts_with_location(pieces):
        problems.append("does not start with a location ('{where}: ', 'name: ' or '--flag ...')")
    text = " ".join(p if isinstance(p, str) else ast.unparse(p) for p in pieces).lower()
    if not any(word in text for word in HINT_WORDS):
        problems.append("says nothing of what would be valid")
    if isinstance(message, ast.IfExp):
        problems += [f"else branch: {p}" for p in _problems(message.orelse)]
    return problems


#: a numbered location: "step {i}: ", "rank {r} (...): ", "stage {index}: "
NUMBERED_LOCATION = re.compile(r"^(rank|pp rank|step|stage|input|output|symbol|feature|parameter) \{\}( \([^()]*\))?$")


def _starts_with_location(pieces: list) -> bool:
    """The text before the first ': ' is one word (placeholders and literal text with no spaces), a numbered
    location such as ``step {i}``, or the message opens with a ``--flag`` or a ``$VARIABLE``."""
    if not pieces:
        return False
    if isinstance(pieces[0], str) and FLAG_FIRST.match(pieces[0]):
        return True
    if pieces[0] in ("$", "--") and len(pieces) > 1 and not isinstance(pieces[1], str):  # f"${ENV_NAME}...", f"--{flag}..."
        return True
    head = ""
    for piece in pieces:
        if not isinstance(piece, str):
            head += "{}"
            continue
        before, sep, _ = piece.partition(": ")
        head += before
        if sep:
            break
    if NUMBERED_LOCATION.match(head):
        return True
    head_has_placeholder = False
    for piece in pieces:
        if not isinstance(piece, str):
            head_has_placeholder = True
            continue
        before, sep, _ = piece.partition(": ")
        if re.search(r"\s", before):
            return False
        if sep:
            return head_has_placeholder or bool(before)
        if piece.endswith(":") and not re.search(r"\s", piece):  # "{where}:" then a newline or placeholder
            return True
    return False


def _allowed(raise_: Raise) -> str | None:
    for prefix, reason in ALLOWLIST_FILES.items():
        if raise_.file == prefix or raise_.file.startswith(prefix + "/"):
            return reason
    return ALLOWLIST.get((raise_.file, raise_.function))


def _pending(raise_: Raise) -> bool:
    return (raise_.file, raise_.function) in HINT_PENDING


ERROR_NAMES = _error_class_names()
RAISES = _raises(ERROR_NAMES)


def test_the_walker_finds_the_package_errors():
    assert {"ShardError", "TrainError", "RankFailureError", "FrameworkUnavailableError"} <= ERROR_NAMES
    assert len(RAISES) > 300


def test_the_rule_rejects_bare_messages():
    bad = ['raise ShardError("bad axis")', 'raise ShardError(f"bad axis {axis}")',
           'raise ShardError(f"Invalid axis {axis}: valid are 0, 1")', 'raise ShardError(f"{where}: bad axis")',
           'raise ShardError(msg)', 'raise ShardError()']
    good = ['raise ShardError(f"{where}: bad axis {axis}: valid axes are 0, 1")',
            'raise ShardError(f"trace: unknown tracer {t!r}: valid are a, b")',
            'raise TrainError(f"--tp {tp} must divide the world size {world}")',
            'raise ShardError("{}: axis {} must be 0 or 1".format(path, axis))']
    for source in bad:
        assert _problems(ast.parse(source).body[0].exc.args[0] if "()" not in source else None), source
    for source in good:
        assert not _problems(ast.parse(source).body[0].exc.args[0]), source


def test_allowlist_entries_still_exist():
    present = {(r.file, r.function) for r in RAISES}
    stale = [key for key in ALLOWLIST if key not in present]
    assert not stale, f"allowlist entries with no raise left: {stale}"


def test_every_error_message_names_where_and_what_is_valid():
    failures = []
    for raise_ in RAISES:
        if _allowed(raise_):
            continue
        problems = _problems(raise_.message)
        if _pending(raise_):
            problems = [p for p in problems if not p.endswith("says nothing of what would be valid")]
        if problems:
            failures.append(f"schedlang/{raise_.file}:{raise_.line} ({raise_.function}): {'; '.join(problems)}\n"
                            f"    {raise_.source[:200]}")
    assert not failures, f"{len(failures)} error messages break the voice:\n" + "\n".join(failures)


def test_pending_hints_are_still_pending():
    """Once every raise of a pending function gives a hint, take it off HINT_PENDING."""
    still = {(r.file, r.function) for r in RAISES
             if _pending(r) and any(p.endswith("says nothing of what would be valid") for p in _problems(r.message))}
    done = sorted(HINT_PENDING - still)
    assert not done, f"these now say what would be valid; remove them from HINT_PENDING: {done}"


# --------------------------------------------------------------------------------------------- run time


class _Block(__import__("torch").nn.Module):
    def __init__(self):
        import torch.nn as nn
        super().__init__()
        self.linear1 = nn.Linear(32, 128)
        self.act = nn.GELU()
        self.linear2 = nn.Linear(128, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.linear2(self.act(self.linear1(x))))


def _schedule():
    import schedlang
    import torch.nn as nn
    return schedlang.create_schedule(nn.Sequential(_Block(), _Block()))


def _checkpoint_twice(sch):
    sch["0"].checkpoint()
    sch["0"].checkpoint()


def _fork_rng_twice(sch):
    sch["0.linear1"].fork_rng()
    sch["0.linear1"].fork_rng()


BAD_CALLS = {
    "shard axis": lambda sch: sch["0.linear1"].shard("weight", axis=5),
    "shard tensor": lambda sch: sch["0.linear1"].shard("weights", axis=0),
    "sync mode": lambda sch: sch["0.linear2"].sync(mode="fwd_middle", sync_op_or_fn="all_reduce"),
    "sync op": lambda sch: sch["0.linear2"].sync(mode="fwd_post", sync_op_or_fn="all_sum"),
    "checkpoint twice": _checkpoint_twice,
    "decompose non-linear": lambda sch: sch["0.act"].decompose(),
    "trace tracer": lambda sch: sch["0"].trace(tracer="jit"),
    "find pattern": lambda sch: sch["0"].find(42),
    "fuse compiler": lambda sch: (sch["0"].trace(flatten=True),
                                  sch["0"].fuse(sch["0"].find(lambda x: __import__("torch").relu(x)),
                                                compiler="tvm")),
    "replace_all type": lambda sch: sch.replace_all(__import__("torch").nn.Conv2d, lambda name, mod: mod),
    "fork_rng twice": _fork_rng_twice,
    "annotate name": lambda sch: sch["0.linear1"].annotate(3, "key", "value"),
    "child path": lambda sch: sch["0.linear9"],
    "shard layernorm axis": lambda sch: sch["0.norm"].shard("weight", axis=1),
}

RUNTIME_FORM = re.compile(r"^(<root>|[^\s:]+|--\S+): \S")


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_primitive_calls_speak_in_the_voice(case):
    sch = _schedule()
    with pytest.raises(schedlang.errors.SchedlangError) as info:
        BAD_CALLS[case](sch)
    message = str(info.value)
    assert RUNTIME_FORM.match(message), f"{case}: message does not start with a location: {message!r}"
    assert any(word in message.lower() for word in HINT_WORDS), f"{case}: no hint of what is valid: {message!r}"
    assert "\n" not in message.splitlines()[0]

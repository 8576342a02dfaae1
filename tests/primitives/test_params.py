"""Argument declarations: the type checker, the words of its messages, and every primitive's declaration."""

from typing import Any, Callable, Dict, Optional, Sequence, Type, Union

import pytest
from torch import nn

import schedlang
from schedlang.primitives.base import get_primitive
from schedlang.primitives.params import check_type, describe_type, format_type


@pytest.mark.parametrize("tp,good,bad", [
    (int, [0, -3], [True, 1.0, "1", None]),
    (bool, [True, False], [0, 1, None]),
    (float, [1, 2.5], [True, "1.0"]),
    (str, ["a", ""], [b"a", 3]),
    (Optional[int], [None, 2], [2.0]),
    (Union[str, Callable[..., Any]], ["x", len, nn.ReLU()], [3, None]),
    (Type[nn.Module], [nn.Linear, nn.Module], [nn.Linear(2, 2), int, "nn.Linear"]),
    (Sequence[str], [[], ["a"], ("a", "b")], ["ab", [1], {"a": 1}]),
    (Sequence[Sequence[str]], [[("a", "b")]], [["ab", 3], [[1]]]),
    (Optional[Dict[str, Any]], [None, {}, {"x": 1}], [{1: 2}, [("x", 1)]]),
    (Any, [None, object()], []),
])
def test_check_type(tp, good, bad):
    assert all(check_type(v, tp) for v in good)
    assert not any(check_type(v, tp) for v in bad)


@pytest.mark.parametrize("tp,words,shown", [
    (int, "an int", "int"),
    (bool, "True or False", "bool"),
    (Optional[int], "None or an int", "Optional[int]"),
    (Optional[Union[bool, int]], "None, True or False or an int", "Optional[Union[bool, int]]"),
    (Type[nn.Module], "an nn.Module subclass", "Type[nn.Module]"),
    (Sequence[str], "a list of strings", "Sequence[str]"),
    (Callable[..., Any], "a callable", "Callable[..., Any]"),
])
def test_types_in_words_and_in_signatures(tp, words, shown):
    assert describe_type(tp) == words
    assert format_type(tp) == shown


@pytest.mark.parametrize("name", schedlang.list_primitives())
def test_every_declaration_is_complete(name):
    primitive = get_primitive(name)
    assert primitive.__doc__ and "Example" in primitive.__doc__ and "::" in primitive.__doc__, f"{name}: no description with an example"
    for p in primitive.params:
        assert p.doc, f"{name}.{p.name}: no description"
        if not p.required and p.default is not None:
            assert check_type(p.default, p.type), f"{name}.{p.name}: default {p.default!r} is not {p.type}"

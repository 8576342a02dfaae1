"""The shared checks of plain arguments: what they accept, what they refuse and how they say it."""

import pytest
import torch

from schedlang.argument_checks import (FLOATING_DTYPES, check_arity, check_int, check_integer_tensor, check_number,
                                       check_tensor, shown)
from schedlang.errors import ArgumentTypeError, ScheduleValueError


def test_ints():
    check_int("f", "n", 3, minimum=1)
    check_int("f", "n", -3)
    with pytest.raises(ScheduleValueError, match=r"^f: n must be an int >= 1, got 0$"):
        check_int("f", "n", 0, minimum=1)
    for wrong in (True, 2.0, "2", None):  # a bool is an int to Python, never a count to a user
        with pytest.raises(ArgumentTypeError, match=rf"^f: n must be an int >= 1, got {shown(wrong)}$"):
            check_int("f", "n", wrong, minimum=1)


def test_numbers():
    check_number("f", "eps", 0, minimum=0)
    check_number("f", "eps", 1e-6, minimum=0)
    for wrong, error in ((float("nan"), ScheduleValueError), (float("inf"), ScheduleValueError),
                         (-1e-6, ScheduleValueError), (False, ArgumentTypeError), ("1e-6", ArgumentTypeError)):
        with pytest.raises(error, match=r"^f: eps must be a finite number >= 0, got "):
            check_number("f", "eps", wrong, minimum=0)


def test_tensors():
    check_tensor("f", "x", torch.zeros(2, 3), FLOATING_DTYPES, min_dim=2)
    with pytest.raises(ArgumentTypeError, match=r"^f: x must be a torch.Tensor, got list$"):
        check_tensor("f", "x", [1.0])
    with pytest.raises(ScheduleValueError, match=r"^f: x has dtype torch.int32: expected one of float32, bfloat16, "
                                                 r"float16, float64$"):
        check_tensor("f", "x", torch.zeros(2, dtype=torch.int32), FLOATING_DTYPES)
    with pytest.raises(ScheduleValueError, match=r"^f: x of shape \(2,\) must have at least 2 dimensions$"):
        check_tensor("f", "x", torch.zeros(2), min_dim=2)
    check_integer_tensor("f", "ids", torch.zeros(2, dtype=torch.uint8))
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(ScheduleValueError, match=rf"^f: ids has dtype {dtype}: expected an integer dtype"):
            check_integer_tensor("f", "ids", torch.zeros(2, dtype=dtype))


def test_arity():
    check_arity("f", "fn", lambda a, b=1, *rest: a, "(a)", (1,))
    check_arity("f", "fn", max, "(a, b)", (1, 2))  # no readable signature: the call itself will tell
    with pytest.raises(ScheduleValueError, match=r"^f: fn\(a\) cannot be called with \(a, b\): too many positional "
                                                 r"arguments; give a function that takes \(a, b\)$"):
        check_arity("f", "fn", lambda a: a, "(a, b)", (1, 2))


def test_long_values_are_cut_to_one_readable_line():
    assert shown(list(range(100))).endswith("...") and len(shown(list(range(100)))) == 60


def test_number_checks_do_not_break_a_graph_under_torch_compile():
    """With dynamic=True a float argument is symbolic; a range check on it would be a data-dependent branch."""
    def scaled(x, eps):
        check_number("scaled", "eps", eps, minimum=0)
        check_int("scaled", "n", x.shape[0], minimum=1)
        return x * eps

    compiled = torch.compile(scaled, backend="eager", dynamic=True, fullgraph=True)
    for eps in (0.5, 0.25):
        torch.testing.assert_close(compiled(torch.ones(3), eps), torch.full((3,), eps))

import pytest
import torch

import schedlang
from schedlang.module_record import module_record
from tests.helpers.models import MLP


def test_annotation_is_set_kept_through_build_and_replay():
    sch = schedlang.create_schedule(MLP())
    sch["fc1"].annotate("weight", "orig_shape", (20, 12))
    assert sch["fc1"].mod.weight.orig_shape == (20, 12)
    sch["fc1"].shard("weight", axis=0)  # a new Parameter: build re-applies annotations
    model, _ = schedlang.build(sch)
    assert model.fc1.weight.orig_shape == (20, 12)
    replayed = schedlang.replay(sch.plan.to_json(), MLP())
    assert module_record(replayed["fc1"].mod).annotations == {"weight": {"orig_shape": [20, 12]}}


@pytest.mark.parametrize("args,error,message", [
    (("w", "k", 1), schedlang.ScheduleKeyError, r"fc1: no parameter 'w' to annotate; valid names: weight, bias"),
    (("weight", "not valid", 1), schedlang.ScheduleTypeError, r"annotation key must be an identifier string"),
    (("weight", "grad", 1), schedlang.ScheduleValueError, r"annotation key 'grad' would shadow a tensor attribute"),
])
def test_annotate_errors(args, error, message):
    sch = schedlang.create_schedule(MLP())
    with pytest.raises(error, match=message):
        sch["fc1"].annotate(*args)


@pytest.mark.parametrize("key", ["T", "is_leaf", "add", "size", "view"])
def test_annotate_refuses_keys_that_are_tensor_attributes_or_methods(key):
    # 'T' and 'is_leaf' cannot be set at all (an AttributeError from torch at apply time); 'size' and the other
    # methods would be silently replaced by the value on the parameter the model computes with
    model = MLP()
    sch = schedlang.create_schedule(model)
    with pytest.raises(schedlang.ScheduleValueError,
                       match=rf"^fc1: annotation key '{key}' would shadow a tensor attribute; choose another name$"):
        sch["fc1"].annotate("weight", key, 1)
    assert len(sch.plan) == 0
    assert callable(sch["fc1"].mod.weight.size) and not hasattr(model.fc1.weight, "note")
    sch["fc1"].annotate("weight", "note", 1)  # a key of its own still works
    assert sch["fc1"].mod.weight.note == 1 and not hasattr(model.fc1.weight, "note")

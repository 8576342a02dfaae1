"""``Verify``: check that a schedule computes what the original model computes.

Used as a context manager around the primitives to check::

    with schedlang.Verify(sch, example_inputs=[x]):
        sch["fc1"].shard("weight", axis=0)
        ...

The pieces:

* :mod:`.core`: the context manager, the eval and the training pass;
* :mod:`.compare`: per-dtype tolerances that follow the length of the reductions;
* :mod:`.counterparts`: which original tensor each scheduled parameter or buffer stands for;
* :mod:`.locate`: module outputs by path, the first divergence, recomputation, attention hints;
* :mod:`.ranks`: the cross-rank steps (broadcasts, agreement, replicated tensors);
* :mod:`.input_agreement`: every rank passes inputs and a model of the same shapes, checked before any broadcast;
* :mod:`.rng`: the caller's random streams kept, the models' streams mirrored and compared;
* :mod:`.split_outputs`: outputs the schedule leaves split on purpose (vocabulary-parallel logits), compared slice
  by slice;
* :mod:`.uniform_factor`: the hint when every gradient is the original's times one factor (the world size: a
  gradient summed over ranks twice), with the sync steps that could do it.
"""

from ..errors import VerificationError
from .compare import DEFAULT_TOLERANCES, Tolerance, tolerance_for
from .core import ExampleInputError, Verify, VerifyReport, VerifyWarning
from .input_agreement import ExampleInputMismatchError

__all__ = ["Verify", "VerifyReport", "VerificationError", "ExampleInputError", "ExampleInputMismatchError",
           "VerifyWarning", "DEFAULT_TOLERANCES",
           "Tolerance", "tolerance_for"]

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
* :mod:`.ranks`: the cross-rank steps (broadcasts, agreement, replicated tensors).
"""

from ..errors import VerificationError
from .compare import DEFAULT_TOLERANCES, Tolerance, tolerance_for
from .core import ExampleInputError, Verify, VerifyReport, VerifyWarning

__all__ = ["Verify", "VerifyReport", "VerificationError", "ExampleInputError", "VerifyWarning", "DEFAULT_TOLERANCES",
           "Tolerance", "tolerance_for"]

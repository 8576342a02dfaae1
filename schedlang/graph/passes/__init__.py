"""Graph passes on traced (FX) modules, one rule per file.

* ``horizontal.py`` drives the atomic horizontal-fusion rules (``linear_same_input``,
  ``linear_batched``, ``layer_norm``, ``activation``, ``split_cat``, ``stack_unbind``,
  ``cat_unbind``) to a fixpoint; ``group_ops.py`` holds the batched operators they emit.
* ``combine_sparse_features.py``: N sparse-feature inputs -> one (indices, lengths) pair.
* ``overlap_communication.py``: collectives issued early and waited for late.
* ``shared_amax.py``: whole-tensor maxima (float8 scales) of one tensor, through any views, computed
  once; an Inductor joint-graph pass that ``compile_layers`` gives float8 layers.
* ``shared_scaled_mm_operand.py``: a float8 operand that several scaled matmuls read (q, k and v's cast
  input) computed into one buffer by Inductor instead of one copy per matmul; an Inductor post-grad pass
  that ``compile_layers`` gives float8 layers.
* ``shared_input_linears.py``: linears on one input (q/k/v, gate/up) as one GEMM on weights concatenated
  per call; an Inductor pre-grad pass (``compile_layers(fuse_projections=True)``).

Modules are imported on use, so ``import schedlang`` stays light.
"""

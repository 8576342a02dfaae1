"""The interpreter switch counts as it was when the kernels were imported: Triton decides at
``@triton.jit`` time whether a kernel is interpreted, so setting ``TRITON_INTERPRET=1`` later must
not send CPU tensors to compiled kernels (it used to, on GPU machines: "cannot be accessed from
Triton (cpu tensor?)"). CPU tensors then take the PyTorch reference."""

import os
import subprocess
import sys
import textwrap

_LATE_SWITCH = textwrap.dedent("""
    import os
    import torch
    from schedlang.kernels import multi_tensor_apply
    from schedlang.kernels.rms_norm import rms_norm
    from schedlang.kernels.rms_norm_reference import rms_norm_reference

    os.environ["TRITON_INTERPRET"] = "1"   # too late: the kernels are already decorated as compiled
    assert not multi_tensor_apply.interpreting()
    x = torch.randn(7, 13, requires_grad=True)
    w = torch.randn(13, requires_grad=True)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x.detach(), w.detach(), 1e-6)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None
    print("ok")
""")


def test_setting_the_interpreter_after_import_keeps_cpu_tensors_on_the_reference():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _LATE_SWITCH], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok"


def test_the_interpreter_switch_set_before_import_is_honoured():
    from schedlang.kernels import multi_tensor_apply

    # the suite sets TRITON_INTERPRET=1 before importing anything on a machine without CUDA
    import torch

    if torch.cuda.is_available():
        assert multi_tensor_apply.interpreting() == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
                                                     and multi_tensor_apply._INTERPRETED_AT_IMPORT)
    else:
        assert multi_tensor_apply.interpreting()

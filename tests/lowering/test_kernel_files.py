"""Generated kernel files: written to a per-process directory that lives as long as the
interpreter (Triton's JIT and tracebacks read the source) and is removed at exit."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from schedlang.lowering import kernel_files

# fuses a kernel, runs it, reports where its source file is, then exits normally
_FUSE_AND_EXIT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.fx, torch.nn.functional as F
    from schedlang.lowering import kernel_files, lower_subgraph

    def bias_gelu(x, b):
        return F.gelu(x + b, approximate="tanh")

    # compiled on a GPU machine, interpreted on the CPU (the parent sets TRITON_INTERPRET then)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(7, 13, device=device, requires_grad=True)
    b = torch.randn(13, device=device, requires_grad=True)
    fused = lower_subgraph(torch.fx.symbolic_trace(bias_gelu), "triton", "BiasGeLU", example_inputs=[x, b])
    fused(x, b).sum().backward()
    directory = kernel_files._KERNEL_DIR
    files = sorted(os.listdir(directory))
    print(json.dumps({"dir": directory, "files": files}))
""")


def test_a_process_that_fuses_a_kernel_leaves_no_directory_behind(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _FUSE_AND_EXIT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    # while the process ran, its kernels were files in its own directory under TMPDIR
    assert os.path.dirname(seen["dir"]) == str(tmp_path)
    assert any(name.startswith("bias_gelu") and name.endswith(".py") for name in seen["files"]), seen
    assert not os.path.exists(seen["dir"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("schedlang")] == []


def test_generated_source_stays_importable_while_the_process_lives():
    module = kernel_files.load_source("VALUE = 41 + 1\n", "answer")
    assert module.VALUE == 42
    path = module.__file__
    assert os.path.isfile(path) and os.path.dirname(path) == kernel_files.kernel_dir()
    assert kernel_files.load_source("VALUE = 41 + 1\n", "answer") is module  # cached by its text


def test_a_forked_child_neither_removes_nor_writes_into_the_parents_directory(monkeypatch, tmp_path):
    parent_dir = kernel_files.kernel_dir()
    saved = (kernel_files._KERNEL_DIR, kernel_files._KERNEL_DIR_PID)
    try:
        # what a forked child sees: the parent's directory name, made by another process
        kernel_files._KERNEL_DIR_PID = os.getpid() + 1
        kernel_files._remove_kernel_dir()
        assert os.path.isdir(parent_dir)
        monkeypatch.setattr(kernel_files.tempfile, "tempdir", str(tmp_path))
        child_dir = kernel_files.kernel_dir()
        assert child_dir != parent_dir and os.path.dirname(child_dir) == str(tmp_path)
        kernel_files._remove_kernel_dir()
        assert not os.path.exists(child_dir) and os.path.isdir(parent_dir)
    finally:
        kernel_files._KERNEL_DIR, kernel_files._KERNEL_DIR_PID = saved

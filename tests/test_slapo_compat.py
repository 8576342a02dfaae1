"""A Slapo schedule script runs with only its import changed (``import schedlang as slapo``)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import warnings
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.distributed as dist
    import schedlang as slapo

    slapo.env.setup(rank=0, world_size=1, backend="gloo")
    print(f"rank: {dist.get_rank()}, world_size: {dist.get_world_size()}")


    class MLP(nn.Module):
        def __init__(self, hidden_size):
            super().__init__()
            self.linear1 = nn.Linear(hidden_size, hidden_size)
            self.activation = nn.GELU()
            self.linear2 = nn.Linear(hidden_size, hidden_size)

        def forward(self, data):
            return self.linear2(self.activation(self.linear1(data)))


    model = MLP(64)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_inputs=[torch.randn(2, 8, 64)]):
        sch["linear1"].shard("weight", axis=0)
        sch["linear1"].shard("bias", axis=0)
        sch["linear2"].shard("weight", axis=1)
        sch["linear2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["linear1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["linear1"].decompose()
    sch.trace(flatten=True)


    def pattern(x, bias):
        x = F.gelu(bias + x)
        return x


    subgraph = sch.find(pattern)
    print("found", len(subgraph), "subgraph of", len(subgraph[0]), "nodes")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sch.fuse(subgraph, compiler="TorchScript", name="BiasGeLU")
    assert any("TorchScript" in str(w.message) for w in caught), [str(w.message) for w in caught]
    opt_model, _ = slapo.build(sch, init_weights=False)
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(opt_model(x), model(x), rtol=1e-4, atol=1e-5)
    print("BiasGeLU_0" in dict(opt_model.named_children()), "ok")
''')


def test_slapo_tutorial_script_runs_with_the_import_changed(tmp_path):
    script = tmp_path / "slapo_mlp.py"
    script.write_text(SCRIPT)
    # as from a user's shell: no rendezvous variables (one process needs none)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "rank: 0, world_size: 1"
    assert "found 1 subgraph of 2 nodes" in lines
    assert lines[-1] == "True ok"

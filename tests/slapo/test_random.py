"""schedlang.random: named streams that work on the CPU, seeds per rank, and checkpointing that keeps
the streams in step."""

import random

import pytest
import torch
import torch.nn.functional as F

from schedlang.errors import ScheduleKeyError, ScheduleTypeError, ScheduleValueError
from schedlang.random import (CudaRNGStatesTracker, get_cuda_rng_tracker, is_random_seed_set,
                              model_parallel_cuda_manual_seed, set_random_seed)


def test_fork_draws_from_the_seeded_stream_and_leaves_the_default_one_alone():
    tracker = CudaRNGStatesTracker()
    tracker.add("tp", 1111)
    torch.manual_seed(0)
    expected_default = torch.rand(5)
    torch.manual_seed(0)
    with tracker.fork("tp"):
        first = torch.rand(4)
    with tracker.fork("tp"):
        second = torch.rand(4)   # the stream continues
    after = torch.rand(5)
    stream = torch.Generator().manual_seed(1111)
    torch.testing.assert_close(torch.cat([first, second]), torch.rand(8, generator=stream))
    torch.testing.assert_close(after, expected_default)


def test_names_and_seeds_are_unique_and_unknown_streams_are_named():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ScheduleValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ScheduleValueError, match="a stream named 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ScheduleKeyError, match=r"no stream named 'model-parallel-rng' \(streams: a\)"):
        with tracker.fork():
            pass
    states = tracker.get_states()
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.set_states(states)
    assert list(tracker.get_states()) == ["a"]


def test_set_random_seed_seeds_everything_and_offsets_stages_and_replicas():
    assert set_random_seed(10, dp_rank=2, pp_rank=1) == 10 + 20 + 100
    a = (random.random(), torch.rand(3))
    set_random_seed(130)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1])
    with pytest.raises(TypeError, match="seed must be an int, got 1.5"):
        set_random_seed(1.5)


def test_model_parallel_seed_gives_each_tensor_parallel_rank_its_stream():
    get_cuda_rng_tracker().reset()
    assert not is_random_seed_set()
    masks = []
    for tp_rank in (0, 1):
        assert model_parallel_cuda_manual_seed(123, tp_rank) == 123 + 2718 + tp_rank
        assert torch.initial_seed() == 123
        with get_cuda_rng_tracker().fork():
            masks.append(F.dropout(torch.ones(1000), 0.5))
    assert is_random_seed_set()
    assert not torch.equal(masks[0], masks[1])
    set_random_seed(7, tp_rank=0, always_enable_tp_seed=True)
    assert torch.initial_seed() == 7 + 2718
    get_cuda_rng_tracker().reset()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_recomputes_with_the_forward_masks_of_the_tracker_stream(use_reentrant):
    from schedlang.checkpoint import checkpoint

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 99)
    lin = torch.nn.Linear(13, 13)

    def block(x):
        with tracker.fork():
            return F.dropout(lin(x), 0.5)

    def run(fn):
        tracker.reset()
        tracker.add("model-parallel-rng", 99)
        torch.manual_seed(3)
        x = torch.randn(7, 13, requires_grad=True)
        out = fn(x)
        out.backward(torch.ones_like(out))
        return out, x.grad

    ref, ref_grad = run(block)
    out, grad = run(lambda x: checkpoint(block, x, use_reentrant=use_reentrant))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, ref_grad)
    # torch's checkpoint alone recomputes with the stream moved on: other masks, other gradient
    _, plain_grad = run(lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
    assert not torch.allclose(plain_grad, ref_grad)
    tracker.reset()


def test_reentrant_checkpoint_refuses_keyword_arguments():
    from schedlang.checkpoint import checkpoint

    with pytest.raises(TypeError, match=r"keyword arguments \['scale'\] need use_reentrant=False"):
        checkpoint(lambda x, scale: x * scale, torch.ones(2), scale=2.0)


def test_get_states_gives_each_stream_its_generator_state():
    tracker = CudaRNGStatesTracker()
    tracker.set_states({"opaque": 1234})  # any value is kept as it is, as Megatron's tracker does
    assert tracker.get_states()["opaque"] == 1234
    tracker.reset()
    tracker.add("s", 1111)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fresh = torch.Generator(device=device).manual_seed(1111).get_state()
    assert torch.equal(tracker.get_states()["s"], fresh)
    with tracker.fork("s"):
        drawn = torch.rand(5, device=device)
    moved = tracker.get_states()["s"]
    assert not torch.equal(moved, fresh)
    # a state from get_states() puts the stream back there: the same numbers again
    tracker.set_states({"s": fresh})
    with tracker.fork("s"):
        again = torch.rand(5, device=device)
    torch.testing.assert_close(again, drawn)
    with pytest.raises(ScheduleTypeError, match=r"stream 'opaque' holds int, not a stream; only streams made by "
                                                r"add\(\) or given a generator state by set_states\(\) can be forked"):
        tracker.set_states({"opaque": 1})
        with tracker.fork("opaque"):
            pass


def test_the_checkpoint_package_is_slapos_checkpoint_function():
    from schedlang import checkpoint

    lin = torch.nn.Linear(6, 6)
    x = torch.randn(4, 6, requires_grad=True)
    out = checkpoint(lambda t: torch.relu(lin(t)), x)
    out.sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ref = torch.relu(lin(ref_x))
    torch.testing.assert_close(out, ref)
    grad = x.grad.clone()
    ref.sum().backward()
    torch.testing.assert_close(grad, ref_x.grad)
    assert callable(checkpoint.save_checkpoint)  # still the checkpoint package

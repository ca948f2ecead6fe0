"""StepTimer against fakes of CUDA events and collectives: a step's events are read only once the
GPU has passed them (no synchronize, ever), and in synchronous training, with an explicit
all-reduce or with DDP's all-reduce overlapping backward, the slow GPU ranks first: longest
compute, shortest collective wait."""

from __future__ import annotations

import pytest

from tests.heartbeat.fakes import FakeGpu, ManualClock, RecordingHeartbeat, fake_torch
from vigil_heartbeat.pytorch import MAX_PENDING_STEPS, StepTimer

TRANSFER = 0.05


def sync_step(timers, gpus, computes, step):
    """One synchronous data-parallel step with an explicit all-reduce after compute."""
    done = []
    for timer, gpu, seconds in zip(timers, gpus, computes, strict=True):
        with timer.compute():
            gpu.enqueue(seconds)
        done.append(gpu.queued_until)
    end = max(done) + TRANSFER  # nobody finishes the collective before the last rank joins it
    for timer, gpu in zip(timers, gpus, strict=True):
        with timer.comm():
            gpu.wait_until(end)
        timer.step(step)
    return end


def test_cuda_events_are_read_a_step_later_without_a_stall_and_rank_the_slow_gpu_first():
    gpus = [FakeGpu(), FakeGpu()]
    beats = [RecordingHeartbeat(), RecordingHeartbeat()]
    timers = [StepTimer(hb, torch_module=fake_torch(gpu)) for hb, gpu in zip(beats, gpus, strict=True)]
    assert all(t.timing == "cuda_events" for t in timers)
    computes = [0.30, 0.40]  # rank 1's GPU is slow
    end = sync_step(timers, gpus, computes, 1)
    # The host is ahead of the GPUs: step 1 is not done, so nothing is read (and nothing waits).
    assert [b.beats[-1]["compute"] for b in beats] == [None, None]
    for step in range(2, 6):
        for gpu in gpus:
            gpu.run_to(end)  # the GPUs finish the previous step while the host queues this one
        end = sync_step(timers, gpus, computes, step)
        fast, slow = (b.beats[-1] for b in beats)
        assert fast["compute"] == pytest.approx(0.30) and fast["comm"] == pytest.approx(0.15)
        assert slow["compute"] == pytest.approx(0.40) and slow["comm"] == pytest.approx(TRANSFER)
        assert slow["compute"] > fast["compute"] and slow["comm"] < fast["comm"]
        assert fast["timing"] == "cuda_events"
    assert all(g.syncs == 0 for g in gpus)


def test_a_gpu_far_behind_the_host_bounds_the_pending_steps():
    gpu = FakeGpu()
    hb = RecordingHeartbeat()
    timer = StepTimer(hb, torch_module=fake_torch(gpu))
    for step in range(1, MAX_PENDING_STEPS + 6):
        with timer.compute():
            gpu.enqueue(1.0)
        timer.step(step)
    assert timer.dropped_steps == 5 and gpu.syncs == 0
    assert all(b["compute"] is None for b in hb.beats)
    gpu.run_to(gpu.queued_until)
    with timer.compute():
        gpu.enqueue(1.0)
    timer.step(99)
    assert hb.beats[-1]["compute"] == pytest.approx(1.0)


def ddp_backward(timer, gpu, buckets, hook):
    """DDP's backward on one rank: each bucket's gradients, then the bucket's hook (its all-reduce
    launched, overlapping the rest of backward); returns when the last bucket is ready on the GPU."""
    for i, seconds in enumerate(buckets):
        gpu.enqueue(seconds)
        assert hook("process-group", f"bucket-{i}") == f"future-{i}"
    return gpu.queued_until


def test_ddp_comm_hook_counts_only_the_exposed_wait_under_overlap():
    gpus = [FakeGpu(), FakeGpu()]
    beats = [RecordingHeartbeat(), RecordingHeartbeat()]
    timers = [StepTimer(hb, torch_module=fake_torch(gpu)) for hb, gpu in zip(beats, gpus, strict=True)]
    reduced = []

    def allreduce(state, bucket):  # the inner hook DDP would run: returns the bucket's future
        reduced.append((state, bucket))
        return "future-" + bucket.rsplit("-", 1)[1]

    hooks = [t.ddp_comm_hook(inner=allreduce) for t in timers]
    forward = [0.10, 0.10]
    backward = [[0.10, 0.10, 0.05], [0.15, 0.15, 0.08]]  # rank 1 is slow
    for step in range(1, 5):
        spans, ready = [], []
        for timer, gpu, fwd, bwd, hook in zip(timers, gpus, forward, backward, hooks, strict=True):
            span = timer.compute()  # forward + backward, as a training loop writes it
            span.__enter__()
            spans.append(span)
            gpu.enqueue(fwd)
            ready.append(ddp_backward(timer, gpu, bwd, hook))
        # DDP's finalize makes each rank's stream wait for the last bucket's all-reduce, which
        # cannot finish before the slowest rank's last bucket is ready; then backward returns.
        last = max(ready) + TRANSFER
        for timer, gpu, span in zip(timers, gpus, spans, strict=True):
            gpu.wait_until(last)
            span.__exit__(None, None, None)
            timer.step(step)
        for gpu in gpus:
            gpu.run_to(last)
    assert len(reduced) == 4 * 2 * 3
    fast, slow = beats[0].beats[-1], beats[1].beats[-1]
    # Compute ends at this rank's last bucket; early buckets' all-reduces overlapped backward.
    assert fast["compute"] == pytest.approx(0.35) and slow["compute"] == pytest.approx(0.48)
    assert fast["comm"] == pytest.approx(0.13 + TRANSFER) and slow["comm"] == pytest.approx(TRANSFER)
    assert all(g.syncs == 0 for g in gpus)


def test_cpu_fallback_times_the_host_and_says_so():
    clock = ManualClock()
    hb = RecordingHeartbeat()
    timer = StepTimer(hb, torch_module=fake_torch(None, available=False), clock=clock)
    assert timer.timing == "cpu"
    hook = timer.ddp_comm_hook(inner=lambda state, bucket: "f")
    with timer.data():
        clock.t += 0.02
    with timer.compute():
        clock.t += 0.2
        hook(None, "b0")
        clock.t += 0.1
        hook(None, "b1")  # the last bucket is ready at 0.32
        clock.t += 0.25  # backward returns once DDP's all-reduce is done
    timer.step(7)
    beat = hb.beats[-1]
    assert beat["timing"] == "cpu" and beat["step"] == 7
    assert beat["compute"] == pytest.approx(0.30) and beat["comm"] == pytest.approx(0.25)
    assert beat["data"] == pytest.approx(0.02)


def test_timing_errors_never_reach_the_training_loop():
    class Broken:
        class cuda:
            @staticmethod
            def is_available():
                return True

            @staticmethod
            def Event(enable_timing=False):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    hb = RecordingHeartbeat()
    timer = StepTimer(hb, torch_module=Broken)
    with timer.compute():
        pass
    with timer.comm():
        pass
    timer.bucket_ready()
    timer.step(1)
    assert hb.beats == [{"step": 1, "compute": None, "comm": None, "data": None, "timing": "cuda_events"}]


class FakeModule:
    """nn.Module's hook API: forward pre-hooks and forward hooks run in registration order around
    the module's work (here: GPU kernels queued on a fake stream)."""

    def __init__(self, work) -> None:
        self.work = work
        self.pre: list = []
        self.post: list = []

    def register_forward_pre_hook(self, hook):
        self.pre.append(hook)
        return hook

    def register_forward_hook(self, hook):
        self.post.append(hook)
        return hook

    def __call__(self, x):
        for hook in self.pre:
            hook(self, (x,))
        out = self.work(x)
        for hook in self.post:
            hook(self, (x,), out)
        return out


def test_fsdp_watch_times_forward_after_the_all_gather_wait_and_ranks_the_slow_gpu_first():
    """Two ranks, four FSDP-wrapped blocks: each block's all-gather (FSDP's pre-forward hook,
    registered before ours) waits for both ranks; rank 1's kernels take 1.5x as long."""
    gpus = [FakeGpu(), FakeGpu()]
    beats = [RecordingHeartbeat(), RecordingHeartbeat()]
    timers = [StepTimer(hb, torch_module=fake_torch(gpu)) for hb, gpu in zip(beats, gpus, strict=True)]
    speed = [1.0, 1.5]
    layers = 4
    gathered: dict[int, float] = {}  # block -> when its all-gather completes (both ranks arrived)

    def blocks_for(rank):
        gpu = gpus[rank]
        blocks = []
        for i in range(layers):
            block = FakeModule(lambda x, gpu=gpu, rank=rank: gpu.enqueue(0.05 * speed[rank]))
            # FSDP's pre-forward hook (registered by fully_shard, before ours): all-gather, and
            # the compute stream waits until every rank has joined it.
            block.register_forward_pre_hook(lambda module, args, i=i, gpu=gpu: gpu.wait_until(gathered[i]))
            blocks.append(block)
        return blocks

    blocks = [blocks_for(0), blocks_for(1)]
    for r in (0, 1):
        timers[r].watch(*blocks[r])
    for step in range(1, 6):
        for i in range(layers):
            gathered[i] = max(g.queued_until for g in gpus) + 0.01  # the later rank's arrival
            for r in (0, 1):
                blocks[r][i](None)
        for r in (0, 1):
            gpus[r].enqueue(0.10 * speed[r])  # backward (its reduce-scatters are waits as well)
        end = max(g.queued_until for g in gpus)
        for r in (0, 1):
            gpus[r].wait_until(end)
            timers[r].step(step)
            gpus[r].run_to(end)
    fast, slow = beats[0].beats[-1], beats[1].beats[-1]
    assert fast["compute"] == pytest.approx(0.20) and slow["compute"] == pytest.approx(0.30)
    assert slow["comm"] < fast["comm"]
    assert fast["compute"] + fast["comm"] == pytest.approx(slow["compute"] + slow["comm"])  # equal steps
    assert all(g.syncs == 0 for g in gpus)

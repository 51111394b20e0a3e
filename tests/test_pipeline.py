"""Pipeline parallelism by hand (common/pipeline.py, lesson 11): equal to one process, and scheduled as claimed.

One spawn per world size (2 and 4 gloo processes) trains DeepMLP cut into stages with every schedule (``runs``);
the tests assert on what it returns: the parameters after three steps against one process trained on the whole
batch with the whole model, the activations each stage held at once, the order of each rank's events, the
messages sent, and a timeline whose causality the shared clock must show.
"""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.experiments.pipeline import (
    TORCH_SCHEDULES,
    ddp_buckets,
    deep_mlp_batch,
    microbatch_bytes,
    pipeline_with_data_parallel,
    plot_timeline,
    replay,
    replay_schedule,
    time_runs,
    time_torch_schedules,
    torch_pipelining_gradients,
    torch_schedule_gradients,
    torch_schedule_order,
)
from common.launch import in_turn, run_on_ranks
from common.models import DeepMLP
from common.pipeline import (
    SCHEDULES,
    ActivationMemory,
    Stage,
    bubble_fraction_formula,
    deep_mlp_layers,
    gpipe,
    measured_bubble_fraction,
    saved_activation_bytes,
    schedule_order,
    stage_bounds,
    stage_module,
)

WIDTH, DEPTH = 32, 6  # 8 layers (stem, 6 blocks, head): 4 per stage on 2 ranks, 2 per stage on 4
BATCH, STEPS, LR = 16, 3, 0.1
RUNS = [("naive", 1), ("gpipe", 4), ("1f1b", 4), ("gpipe", 8), ("1f1b", 8)]  # (schedule, micro-batches)


def whole_batch(step: int):
    """Step ``step``'s batch, the same in every process."""
    generator = torch.Generator().manual_seed(step)
    X = torch.randn(BATCH, *DeepMLP.input_shape, generator=generator)
    y = torch.randint(0, 10, (BATCH,), generator=generator)
    return X, y


def make_model() -> DeepMLP:
    torch.manual_seed(0)  # every rank builds the same model, then keeps its stage
    return DeepMLP(width=WIDTH, depth=DEPTH)


def train_stage(env, schedule, num_microbatches: int) -> dict:
    """``STEPS`` SGD steps of this rank's stage under ``schedule`` (a name in ``SCHEDULES``, or a function with
    ``gpipe``'s arguments, such as a lab's): its parameters, records and losses."""
    module = stage_module(deep_mlp_layers(make_model()), env.rank, env.world_size)
    stage = Stage(module, env.rank, env.world_size, DeepMLP.input_shape, BATCH)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    records, losses = [], []
    for step in range(STEPS):
        X, y = whole_batch(step)
        inputs = X if stage.is_first else None
        targets = y if stage.is_last else None
        optimizer.zero_grad(set_to_none=True)
        if schedule == "naive":
            loss, record = SCHEDULES["naive"](stage, inputs, targets)
        else:
            run = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
            loss, record = run(stage, num_microbatches, inputs, targets)
        optimizer.step()
        records.append(record)
        losses.append(loss)
    parameters = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    return {"parameters": parameters, "records": records, "losses": losses}


def every_schedule(env) -> dict:
    return {f"{schedule}/m={m}": train_stage(env, schedule, m) for schedule, m in RUNS}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world_size: f"p={world_size}")
def runs(request):
    """Each rank's results of every run in ``RUNS`` on ``request.param`` processes: a list indexed by rank."""
    return run_on_ranks(every_schedule, request.param, timeout=120)


@pytest.fixture(scope="module")
def one_process() -> dict:
    return train_one_process()


def train_one_process() -> dict:
    """The whole model trained on the whole batch in this process: its final layers and each step's loss."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        X, y = whole_batch(step)
        loss = F.cross_entropy(model(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"layers": deep_mlp_layers(model), "losses": losses}


@pytest.mark.timeout(150)
def test_every_schedule_after_three_steps_equals_one_process_on_the_whole_batch(runs, one_process):
    world_size = len(runs)
    for rank, results in enumerate(runs):
        expected = stage_module(one_process["layers"], rank, world_size).state_dict()
        for run, result in results.items():
            assert result["parameters"].keys() == expected.keys()
            for name, tensor in expected.items():
                torch.testing.assert_close(result["parameters"][name], tensor, msg=f"{run}, rank {rank}, {name}")
    for run, result in runs[-1].items():
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(one_process["losses"]), msg=run)
    for run, result in runs[0].items():
        if world_size > 1:
            assert result["losses"] == [None] * STEPS, f"{run}: only the last stage has a loss"


@pytest.mark.timeout(150)
def test_gpipe_holds_every_microbatch_and_1f1b_at_most_p_minus_rank(runs):
    world_size = len(runs)
    for rank, results in enumerate(runs):
        for run, result in results.items():
            schedule, m = run.split("/m=")
            expected = {"naive": 1, "gpipe": int(m), "1f1b": min(int(m), world_size - rank)}[schedule]
            peaks = [record["peak_in_flight"] for record in result["records"]]
            assert peaks == [expected] * STEPS, f"{run}, rank {rank}"


@pytest.mark.timeout(150)
def test_the_measured_peak_is_m_microbatches_for_gpipe_and_p_minus_rank_for_1f1b(runs):
    """``peak_activation_bytes``, measured in the schedule (saved tensors and message buffers, each counted while
    something holds it), against one micro-batch's saved bytes measured apart: about the micro-batches held. On
    top of them a stage may hold one gradient each way at its peak: the one it received for the backward under way
    (not on the last stage) and its input's gradient, whose send is pending until the next backward (not on stage
    0). Boundary tensors kept after their backward, by handles of sends left waiting, go over that margin."""
    world_size = len(runs)
    for run in runs[0]:
        schedule, m = run.split("/m=")
        sizes = microbatch_bytes(WIDTH, DEPTH, world_size, BATCH // int(m))
        for rank, results in enumerate(runs):
            held = {"naive": 1, "gpipe": int(m), "1f1b": min(int(m), world_size - rank)}[schedule]
            one = sizes[rank]
            gradients = (0 if rank == 0 else one["input"]) + (0 if rank == world_size - 1 else one["output"])
            for record in results[run]["records"]:
                peak = record["peak_activation_bytes"]
                microbatches = f"{peak / one['saved']:.2f} micro-batches, expected {held}"
                assert held * one["saved"] <= peak <= held * one["saved"] + gradients, (
                    f"{run}, rank {rank}: {microbatches}"
                )


def test_activation_memory_holds_saved_tensors_once_until_the_backward_frees_them():
    rows = 4
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    memory = ActivationMemory(module.parameters())
    X = torch.randn(rows, 8)
    with memory.saving():
        loss = module(X).sum()
    # The input (4 x 8) and the ReLU's output (4 x 16, saved by the ReLU and by the second Linear: once); the
    # weights, saved by the Linears, are parameters.
    assert memory.held_bytes == memory.peak_bytes == (rows * 8 + rows * 16) * 4
    received = torch.randn(rows, 16)
    memory.hold(received, received)  # a message buffer: held while the tensor lives
    assert memory.held_bytes == (rows * 8 + 2 * rows * 16) * 4
    loss.backward()  # frees the saved tensors
    assert memory.held_bytes == rows * 16 * 4
    del received
    assert memory.held_bytes == 0 and memory.peak_bytes == (rows * 8 + 2 * rows * 16) * 4


def send_and_watch(env) -> list[int]:
    """Rank 0 isends a tensor, held by an ``ActivationMemory``, and drops its own reference: the bytes held after
    that, after ``wait()``, and after the handle is dropped. Rank 1 receives it."""
    if env.rank == 1:
        dist.recv(torch.empty(256), src=0)
        return []
    memory = ActivationMemory()
    tensor = torch.randn(256)
    memory.hold(tensor, tensor)
    work = dist.isend(tensor, dst=1)
    del tensor
    held = [memory.held_bytes]
    work.wait()
    held.append(memory.held_bytes)
    del work
    return [*held, memory.held_bytes]


@pytest.mark.timeout(60)
def test_a_tensor_handed_to_isend_is_held_until_the_sends_handle_is_dropped():
    """What makes a send's handle kept to the end of the step cost memory, and ``ActivationMemory`` see it: gloo's
    send work keeps the tensor, even after ``wait()``."""
    held = run_on_ranks(send_and_watch, 2, timeout=45)[0]
    assert held == [256 * 4, 256 * 4, 0]


RECEIVER_SLEEPS = 1.0  # seconds before rank 1 posts its receive


def time_a_blocking_send(env) -> list[float]:
    """Rank 0 sends with ``dist.send`` (blocking), once with 1 element and once with 1M: the seconds each send took.
    Rank 1 sleeps ``RECEIVER_SLEEPS`` before each receive; a barrier starts both rounds together."""
    times = []
    for numel in (1, 2**20):
        dist.barrier()
        if env.rank == 1:
            time.sleep(RECEIVER_SLEEPS)
            dist.recv(torch.empty(numel), src=0)
            continue
        start = time.perf_counter()
        dist.send(torch.ones(numel), dst=1)
        times.append(time.perf_counter() - start)
    return times


@pytest.mark.timeout(60)
def test_a_blocking_gloo_send_returns_only_once_the_receiver_posts_its_receive():
    """Why the schedules send with ``isend``: on gloo, ``dist.send`` waits until the peer gets to its ``recv``, even
    for one element, so two blocking sends that face each other (1F1B's steady state) would wait forever."""
    seconds = run_on_ranks(time_a_blocking_send, 2, timeout=45)[0]
    assert all(took > 0.8 * RECEIVER_SLEEPS for took in seconds), seconds


def expected_one_f_one_b(world_size: int, rank: int) -> list[str]:
    """1F1B's events for 4 micro-batches, written out by hand (warm-up | steady | cool-down)."""
    return {
        (2, 0): ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],  # F0 | F1 B0 F2 B1 F3 B2 | B3
        (2, 1): ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],  # no warm-up
        (4, 0): ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"],  # F0 F1 F2 | F3 B0 | B1 B2 B3
        (4, 1): ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],  # F0 F1 | F2 B0 F3 B1 | B2 B3
        (4, 2): ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],  # F0 | F1 B0 F2 B1 F3 B2 | B3
        (4, 3): ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    }[world_size, rank]


@pytest.mark.timeout(150)
def test_each_rank_runs_its_events_in_the_order_of_its_schedule(runs):
    world_size = len(runs)
    for rank, results in enumerate(runs):
        orders = {
            run: [[f"{e['kind']}{e['microbatch']}" for e in record["events"]] for record in result["records"]]
            for run, result in results.items()
        }
        assert orders["naive/m=1"] == [["F0", "B0"]] * STEPS
        for m in (4, 8):
            all_forwards_then_backwards_in_reverse = [f"F{i}" for i in range(m)] + [f"B{i}" for i in reversed(range(m))]
            assert orders[f"gpipe/m={m}"] == [all_forwards_then_backwards_in_reverse] * STEPS, f"rank {rank}"
        assert orders["1f1b/m=4"] == [expected_one_f_one_b(world_size, rank)] * STEPS, f"rank {rank}"


@pytest.mark.timeout(150)
def test_each_stage_sends_one_activation_forward_and_one_gradient_back_per_microbatch(runs):
    world_size = len(runs)
    for rank, results in enumerate(runs):
        for run, result in results.items():
            m = int(run.split("/m=")[1])
            expected = {"activations": 0 if rank == world_size - 1 else m, "gradients": 0 if rank == 0 else m}
            assert [record["messages_sent"] for record in result["records"]] == [expected] * STEPS, f"{run}, {rank}"


@pytest.mark.timeout(150)
def test_the_timeline_is_causal_a_stage_starts_a_microbatch_after_its_neighbour_finished_it(runs):
    """Each rank's events do not overlap, and stage r + 1's forward of a micro-batch starts after stage r's ended
    (its backward, before stage r's): on one machine the ranks' ``perf_counter`` share one clock."""
    for run in runs[0]:
        for step in range(STEPS):
            records = [results[run]["records"][step] for results in runs]
            for record in records:
                ends_and_next_starts = zip(record["events"], record["events"][1:])
                assert all(event["end"] <= following["start"] for event, following in ends_and_next_starts)
            for before, after in zip(records, records[1:]):
                times = {(e["kind"], e["microbatch"]): e for e in before["events"]}
                later = {(e["kind"], e["microbatch"]): e for e in after["events"]}
                for (kind, microbatch), event in later.items():
                    if kind == "F":
                        assert times[kind, microbatch]["end"] < event["start"], f"{run}: F{microbatch}"
                    else:
                        assert event["end"] < times[kind, microbatch]["start"], f"{run}: B{microbatch}"
            assert 0 < measured_bubble_fraction(records) < 1


def test_the_bubble_formula():
    assert bubble_fraction_formula(4, 1) == 0.75  # naive: 3 of 4 stages wait
    assert bubble_fraction_formula(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction_formula(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction_formula(1, 5) == 0  # one stage never waits
    # Interleaved, v = 2 stages per rank: idle (p - 1) / (v m) of the work, (p - 1) / (v m + p - 1) of the step.
    assert bubble_fraction_formula(4, 4, stages_per_rank=2) == pytest.approx(3 / 11)
    assert bubble_fraction_formula(2, 4, stages_per_rank=2) == pytest.approx(1 / 9)


@pytest.mark.timeout(150)
def test_schedule_order_is_the_order_the_schedules_run(runs):
    world_size = len(runs)
    for rank, results in enumerate(runs):
        for run, result in results.items():
            schedule, m = run.split("/m=")
            expected = [
                f"{kind}{microbatch}" for kind, microbatch in schedule_order(schedule, rank, world_size, int(m))
            ]
            for record in result["records"]:
                assert [f"{e['kind']}{e['microbatch']}" for e in record["events"]] == expected, f"{run}, rank {rank}"


def equal_stages(num_stages: int, forward: float = 1.0, backward: float = 2.0) -> dict:
    return {"F": [forward] * num_stages, "B": [backward] * num_stages}


def test_the_replay_of_equal_stages_gives_the_bubble_formula():
    for p in (2, 3, 4):
        for m in (1, 2, 4, 8):
            for schedule in ("gpipe", "1f1b"):
                records = replay_schedule(schedule, p, m, equal_stages(p))
                assert measured_bubble_fraction(records) == pytest.approx(bubble_fraction_formula(p, m)), (
                    schedule,
                    p,
                    m,
                )
                # Each rank's events follow its order, and none overlaps the next.
                for rank, record in enumerate(records):
                    expected = [f"{kind}{i}" for kind, i in schedule_order(schedule, rank, p, m)]
                    assert [f"{e['kind']}{e['microbatch']}" for e in record["events"]] == expected
                    assert all(a["end"] <= b["start"] for a, b in zip(record["events"], record["events"][1:]))
    # torch's interleaved 1F1B, 2 stages per rank, each half a rank's layers: (p - 1) / (v m + p - 1).
    for p, m in ((2, 4), (2, 8), (4, 8)):
        records = replay(torch_schedule_order("Interleaved1F1B", p, m), equal_stages(2 * p, 0.5, 1.0))
        expected = bubble_fraction_formula(p, m, stages_per_rank=2)
        assert measured_bubble_fraction(records) == pytest.approx(expected), (p, m)


def test_with_a_slower_first_stage_1f1b_idles_less_than_gpipe_and_with_a_slower_last_stage_the_same():
    """On unequal stages the formula's "same bubble" breaks: GPipe makes the slower stage 0 wait for one whole
    micro-batch of stage 1 between its forwards and its backwards; 1F1B fills that wait with its own work."""
    m = 4
    slow_first = {"F": [1.2, 1.0], "B": [2.4, 2.0]}
    gpipe_bubble, one_f_one_b_bubble = (
        measured_bubble_fraction(replay_schedule(schedule, 2, m, slow_first)) for schedule in ("gpipe", "1f1b")
    )
    assert one_f_one_b_bubble < gpipe_bubble - 0.01
    slow_last = {"F": [1.0, 1.2], "B": [2.0, 2.4]}
    gpipe_bubble, one_f_one_b_bubble = (
        measured_bubble_fraction(replay_schedule(schedule, 2, m, slow_last)) for schedule in ("gpipe", "1f1b")
    )
    assert one_f_one_b_bubble == pytest.approx(gpipe_bubble)
    # The naive schedule on 2 stages idles half the step whatever the stages: each waits for the other's work.
    assert measured_bubble_fraction(replay_schedule("naive", 2, 1, slow_first)) == pytest.approx(0.5)


def test_the_replay_charges_each_message_between_ranks_and_refuses_an_order_that_deadlocks():
    # Naive on 2 stages: F0 on stage 0, F0 and B0 on stage 1, B0 on stage 0; two messages cross, 0.5 each.
    records = replay_schedule("naive", 2, 1, equal_stages(2), message_seconds=0.5)
    assert [(e["start"], e["end"]) for e in records[0]["events"]] == [(0, 1), (5, 7)]
    assert [(e["start"], e["end"]) for e in records[1]["events"]] == [(1.5, 2.5), (2.5, 4.5)]
    # A backward before its own forward waits forever.
    with pytest.raises(ValueError, match="deadlocks"):
        replay([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], equal_stages(2))


def test_splitting_the_backward_lets_zero_bubble_schedules_fill_the_bubble_that_interleaving_leaves():
    """torch's zero-bubble schedules run the input's gradient (I) first, which the stage before waits for, and the
    weights' (W) later, where a stage would otherwise wait. Replayed with F = I = W on equal stages, they idle less
    than interleaved 1F1B, whose full backward is F's twice."""
    p, m = 2, 8
    split = {"F": [1.0] * 4, "I": [1.0] * 4, "W": [1.0] * 4}
    interleaved = measured_bubble_fraction(replay(torch_schedule_order("Interleaved1F1B", p, m), equal_stages(4)))
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        orders = torch_schedule_order(schedule, p, m)
        assert {kind for order in orders for kind, _, _ in order} == {"F", "I", "W"}
        assert measured_bubble_fraction(replay(orders, split)) < interleaved / 2, schedule


def test_the_measured_bubble_is_the_mean_idle_share_of_the_step_span():
    def event(start, end):
        return {"kind": "F", "microbatch": 0, "start": start, "end": end}

    # The step spans 0..4; rank 0 works 0..1 and 3..4 (idle 1/2), rank 1 works 1..3 (idle 1/2), rank 2 0..1 (3/4).
    records = [{"events": [event(0, 1), event(3, 4)]}, {"events": [event(1, 3)]}, {"events": [event(0, 1)]}]
    assert measured_bubble_fraction(records) == pytest.approx((0.5 + 0.5 + 0.75) / 3)
    with pytest.raises(ValueError, match="no events"):
        measured_bubble_fraction([{"events": []}])


def test_stage_bounds_are_contiguous_and_balanced_by_count():
    assert stage_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # the first stages take the extra layers
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_bounds(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="cannot cut 3 layer"):
        stage_bounds(3, 4)
    with pytest.raises(ValueError, match="at least one stage"):
        stage_bounds(3, 0)


def test_the_deep_mlp_layers_in_sequence_are_the_model():
    model = make_model()
    layers = deep_mlp_layers(model)
    X, _ = whole_batch(0)
    torch.testing.assert_close(nn.Sequential(*layers)(X), model(X))
    assert [id(p) for p in nn.Sequential(*layers).parameters()] == [id(p) for p in model.parameters()]
    stages = [stage_module(layers, rank, 4) for rank in range(4)]
    assert [len(stage) for stage in stages] == [2, 2, 2, 2]


def test_a_batch_that_does_not_split_into_equal_microbatches_is_refused():
    # One stage is first and last: no messages, no process group needed.
    module = stage_module(deep_mlp_layers(make_model()), 0, 1)
    stage = Stage(module, 0, 1, DeepMLP.input_shape, BATCH)
    X, y = whole_batch(0)
    with pytest.raises(ValueError, match="does not split into 3 equal"):
        gpipe(stage, 3, X, y)
    loss, record = gpipe(stage, 4, X, y)
    torch.testing.assert_close(loss, F.cross_entropy(make_model()(X), y))
    assert record["peak_in_flight"] == 4


# The notebook's helpers (common/experiments/pipeline.py, lesson 11's notebook) and the measuring ones.


@pytest.mark.timeout(90)
def test_torch_pipelining_gpipe_on_the_same_stages_gives_the_gradients_of_one_process():
    width, depth, batch, num_microbatches = 32, 2, 16, 4
    ranks = run_on_ranks(torch_pipelining_gradients, 2, num_microbatches, width, depth, batch, timeout=60)
    torch.manual_seed(0)  # the seed the stages were built with
    model = DeepMLP(width=width, depth=depth)
    X, y = deep_mlp_batch(batch, 0)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    for rank, result in enumerate(ranks):
        expected = {name: p.grad for name, p in stage_module(deep_mlp_layers(model), rank, 2).named_parameters()}
        assert result["gradients"].keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(result["gradients"][name], grad, msg=f"rank {rank}, {name}")
    assert ranks[0]["loss"] is None
    torch.testing.assert_close(ranks[1]["loss"], loss.detach())


@pytest.mark.timeout(90)
def test_time_runs_interleaves_every_run_and_records_each_step():
    runs = [("naive", 1), ("gpipe", 2), ("1f1b", 4), ("ddp", 2)]
    ranks = run_on_ranks(time_runs, 2, runs, 16, 2, 8, 3, timeout=60)
    for rank, results in enumerate(ranks):
        assert list(results) == ["naive/m=1", "gpipe/m=2", "1f1b/m=4", "ddp"]
        assert "records" not in results["ddp"]
        for name, result in results.items():
            assert len(result["step_seconds"]) == 3 and all(seconds > 0 for seconds in result["step_seconds"])
        assert [record["peak_in_flight"] for record in results["1f1b/m=4"]["records"]] == [2 - rank] * 3
        assert [len(record["events"]) for record in results["gpipe/m=2"]["records"]] == [4] * 3
    # Interleaved: each run's second step starts after every run's first step ended.
    first_round_end = max(ranks[0][name]["records"][0]["events"][-1]["end"] for name in ("naive/m=1", "1f1b/m=4"))
    assert ranks[0]["naive/m=1"]["records"][1]["events"][0]["start"] > first_round_end


def torch_schedules_and_ddp_buckets(env) -> list:
    """In one process group: every torch schedule's gradients on a small DeepMLP, two timed steps of the
    multi-stage ones, and the DDP buckets of the notebook's model."""
    width, depth, batch, m = 32, 2, 16, 4
    calls = [(torch_schedule_gradients, (schedule, m, width, depth, batch)) for schedule in TORCH_SCHEDULES]
    multi = [(schedule, m) for schedule, (_, per_rank) in TORCH_SCHEDULES.items() if per_rank > 1]
    calls.append((time_torch_schedules, (multi, width, depth, batch, 2)))
    calls.append((ddp_buckets, (1024, 4, 16)))
    return in_turn(env, calls)


@pytest.fixture(scope="module")
def torch_runs():
    return run_on_ranks(torch_schedules_and_ddp_buckets, 2, timeout=150)


@pytest.mark.timeout(180)
def test_torch_interleaved_and_zero_bubble_schedules_give_the_gradients_of_one_process(torch_runs):
    width, depth, batch = 32, 2, 16
    torch.manual_seed(0)
    model = DeepMLP(width=width, depth=depth)
    X, y = deep_mlp_batch(batch, 0)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    for index, (schedule, (_, per_rank)) in enumerate(TORCH_SCHEDULES.items()):
        num_stages = 2 * per_rank
        expected = {
            f"{stage}/{name}": p.grad
            for stage in range(num_stages)
            for name, p in stage_module(deep_mlp_layers(model), stage, num_stages).named_parameters()
        }
        got = {name: grad for rank in torch_runs for name, grad in rank[index]["gradients"].items()}
        assert got.keys() == expected.keys(), schedule
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, msg=f"{schedule}, {name}")
        losses = [rank[index]["loss"] for rank in torch_runs if rank[index]["loss"] is not None]
        assert len(losses) == 1, schedule
        torch.testing.assert_close(losses[0], loss.detach(), msg=schedule)


@pytest.mark.timeout(180)
def test_time_torch_schedules_records_each_computation_in_the_order_torch_gives(torch_runs):
    timed = [rank[len(TORCH_SCHEDULES)] for rank in torch_runs]
    for name in timed[0]:
        schedule, m = name.split("/m=")
        expected = torch_schedule_order(schedule, 2, int(m))
        for rank, results in enumerate(timed):
            assert len(results[name]["step_seconds"]) == 2
            for record in results[name]["records"]:
                assert [(e["kind"], e["microbatch"], e["stage"]) for e in record["events"]] == expected[rank], name
                assert all(e["start"] <= e["end"] for e in record["events"])


@pytest.mark.timeout(180)
def test_ddps_last_bucket_holds_the_stem_and_most_of_the_gradients(torch_runs):
    """The notebook's DDP run (DeepMLP width 1024, depth 4): after its first step DDP all-reduces a 4 MiB bucket
    (the head and the last block) during the backward, then a 15 MiB one that holds the stem, whose gradient is the
    backward's last: most of the bytes start only when the backward ends."""
    for rank in torch_runs:
        buckets = rank[len(TORCH_SCHEDULES) + 1]
        assert [bucket["bytes"] for bucket in buckets] == [4_239_400, 15_810_560]
        assert sorted(buckets[0]["parameters"]) == ["blocks.3.0.bias", "blocks.3.0.weight", "head.bias", "head.weight"]
        assert "stem.1.weight" in buckets[1]["parameters"]


@pytest.mark.slow  # 4 processes on 2 cores: about 20 s
@pytest.mark.timeout(180)
def test_a_pipeline_with_data_parallelism_all_reduces_once_per_step_and_equals_one_process():
    """2 stages x 2 copies under torch's Schedule1F1B, 8 micro-batches per copy, each stage wrapped in DDP over its
    copies: one all-reduce per stage and step (the stages are one bucket each), not one per micro-batch, and the
    gradients of one process on the whole batch."""
    width, depth, batch, num_microbatches = 32, 2, 32, 8
    ranks = run_on_ranks(pipeline_with_data_parallel, 4, 2, num_microbatches, width, depth, batch, timeout=150)
    torch.manual_seed(0)
    model = DeepMLP(width=width, depth=depth)
    X, y = deep_mlp_batch(batch, 0)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    assert [(rank["stage"], rank["copy"]) for rank in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for rank in ranks:
        assert rank["all_reduces"] == 1, rank["stage"]
        # The shape-learning forward runs the DDP module outside no_sync, so micro-batch 0's backward all-reduces too
        assert rank["first_step_all_reduces"] == 2, rank["stage"]
        expected = dict(stage_module(deep_mlp_layers(model), rank["stage"], 2).named_parameters())
        for name, grad in rank["gradients"].items():
            torch.testing.assert_close(grad, expected[name].grad, msg=f"stage {rank['stage']}, {name}")
    copies_mean = (ranks[1]["loss"] + ranks[3]["loss"]) / 2  # each copy's mean loss on half the batch
    torch.testing.assert_close(copies_mean, loss.detach())


def test_saved_activation_bytes_counts_each_saved_tensor_once_and_no_parameters():
    rows = 4
    # Linear saves its input (4 x 8) and its weight (a parameter: not counted); ReLU saves its output (4 x 16),
    # which the second Linear saves again as its input: counted once.
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    assert saved_activation_bytes(module, torch.randn(rows, 8)) == (rows * 8 + rows * 16) * 4
    assert saved_activation_bytes(module, torch.randn(2 * rows, 8)) == 2 * (rows * 8 + rows * 16) * 4
    # A micro-batch that is a slice of a larger batch holds its own rows, not the batch's.
    assert saved_activation_bytes(module, torch.randn(8 * rows, 8).chunk(8)[3]) == (rows * 8 + rows * 16) * 4


def test_plot_timeline_draws_a_labelled_box_per_event_in_its_stage_row():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def event(kind, microbatch, start, end):
        return {"kind": kind, "microbatch": microbatch, "start": start, "end": end}

    records = [
        {"rank": 0, "events": [event("F", 0, 10.0, 10.001), event("B", 0, 10.004, 10.005)]},
        {"rank": 1, "events": [event("F", 0, 10.002, 10.003), event("B", 0, 10.003, 10.004)]},
    ]
    fig, ax = plt.subplots()
    plot_timeline(records, ax, "two stages")
    boxes = [collection.get_paths()[0].get_extents() for collection in ax.collections]
    assert [(round(box.x0, 6), round(box.x1, 6)) for box in boxes] == [(0, 1), (4, 5), (2, 3), (3, 4)]  # ms
    assert [round((box.y0 + box.y1) / 2, 6) for box in boxes] == [0, 0, 1, 1]
    assert [text.get_text() for text in ax.texts] == ["F0", "B0", "F0", "B0"]
    assert ax.get_title() == "two stages"
    plt.close(fig)

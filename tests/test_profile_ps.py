"""tools.profile_ps: what its trace's ops are counted as (the run itself is a benchmark)."""

import pytest

from tools import profile_ps


@pytest.mark.parametrize("name, kind", [
    ("while/body/_1/while/cnn/dense/MatMul/concat/ReadVariableOp/_32:_Send",
     "transfers to and from other tasks"),
    ("while/body/_1/gradient_tape/while/cnn/conv2d_1/Conv2D/Conv2DBackpropFilter:"
     "Conv2DBackpropFilter", "forward and backward"),
    ("while/body/_1/while/cnn/conv2d/Relu:_FusedConv2D", "forward and backward"),
    ("while/body/_1/while/Adam/ResourceApplyAdam_4:ResourceApplyAdam", "the optimizer's update"),
    ("while/body/_1/while/RandomIndexShuffle:RandomIndexShuffle",
     "reading the batch, loss and metrics"),
    ("Adam/CollectiveReduceV2:CollectiveReduceV2", "the all-reduce"),
])
def test_each_op_is_counted_by_what_it_does(name, kind):
    assert profile_ps.op_kind(name, "cnn") == kind


def test_a_traces_closures_are_its_training_functions_calls():
    events = [("t", "EagerLocalExecute: __inference_steps_995", 10, 5),
              ("t", "EagerLocalExecute: __inference_train_function_12", 1, 3),
              ("t", "EagerLocalExecute: __inference_test_function_7", 30, 9),
              ("t", "while/cnn/dense/MatMul:MatMul", 11, 1)]
    assert profile_ps.closures(events) == [(1, 3), (10, 5)]


def test_a_synchronous_runs_contributions_are_its_closures():
    events = [("t", "EagerLocalExecute: __inference_contribution_1645", 4, 2),
              ("t", "EagerLocalExecute: __inference__poll_1111", 1, 1)]
    assert profile_ps.closures(events) == [(4, 2)]


def test_the_chiefs_steps_are_its_closures_or_in_sync_mode_its_updates():
    asynchronous = [("c1", "steps", 0, 2_000_000_000), ("c2", "steps", 0, 4_000_000_000),
                    ("c1", "EagerLocalExecute: __inference_steps_3", 0, 1)]
    assert profile_ps.chief_figures(asynchronous, per_closure=8) == (
        16, {"closures": 2, "closure_call_ms": 3.0})
    # Four contributions (two an update of two workers), two updates, polls between.
    synchronous = [*[("c", "contribution", 0, 6_000_000_000)] * 4,
                   *[("m", "_update", 0, 1_000_000_000)] * 2,
                   *[("m", "_poll", 0, 1)] * 9]
    assert profile_ps.chief_figures(synchronous, per_closure=1) == (
        2, {"closures": 4, "closure_call_ms": 6.0, "updates": 2, "update_call_ms": 1.0})


def test_op_time_per_step_is_summed_by_kind_and_leaves_out_calls():
    events = [("t1", "while/cnn/dense/MatMul:MatMul", 0, 4_000_000_000),  # 4 ms
              ("t2", "while/cnn/dense/MatMul:MatMul", 0, 2_000_000_000),
              ("t1", "while/x/_3:_Recv", 0, 6_000_000_000),
              ("t1", "EagerLocalExecute: __inference_steps_9", 0, 90_000_000_000)]
    figures = profile_ps._by_kind(events, "cnn", steps=2)
    assert figures["forward and backward"] == 3.0
    assert figures["transfers to and from other tasks"] == 3.0
    assert figures["top op types"] == {"MatMul": 3.0, "_Recv": 3.0}


def test_the_step_is_the_last_one_logged_not_the_first_left_in_the_pipe():
    # A backlog of step lines, as the pipe holds after the trace: the step is the last.
    steps = profile_ps.Steps([f"[chief:0] INFO step {n}\n" for n in range(10, 310, 10)])
    assert steps.reach(20) == 300
    assert steps.step == 300 and len(steps.log) == 30
    with pytest.raises(RuntimeError, match="ended before step 310"):
        steps.reach(310)


def test_steps_wait_for_the_step_as_it_is_logged():
    import os
    import threading

    read, write = os.pipe()
    lines, out = open(read), open(write, "w")
    steps = profile_ps.Steps(lines)
    reached = []
    waiter = threading.Thread(target=lambda: reached.append(steps.reach(20)))
    waiter.start()
    print("[worker:0] INFO step 10", file=out, flush=True)
    print("[ps:0] INFO something else", file=out, flush=True)
    assert not reached  # step 10 is not 20
    print("[worker:0] INFO step 20", file=out, flush=True)
    waiter.join(timeout=60)
    assert reached == [20]
    out.close()
    with pytest.raises(RuntimeError, match="ended before step 30"):
        steps.reach(30)  # returns once the reader has seen the end
    lines.close()

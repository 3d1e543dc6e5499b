"""DeepSpeed's instruction schedules (their invariants) and the choice of torch schedule."""

from __future__ import annotations

import pytest

from shardwise.config import load_config
from shardwise.config.errors import ConfigError
from shardwise.pipe import executor
from shardwise.pipe import schedule as s


@pytest.mark.parametrize(("stages", "micro"), [(1, 3), (2, 4), (3, 8), (4, 2)])
def test_train_schedule_runs_each_micro_batch_once_forward_then_backward(stages: int, micro: int) -> None:
    for stage in range(stages):
        sched = s.TrainSchedule(micro_batches=micro, stages=stages, stage_id=stage)
        steps = list(sched)
        assert len(steps) == 2 * (micro + stages - 1)
        order = [
            (type(c).__name__, c.buffer_id)
            for cmds in steps
            for c in cmds
            if isinstance(c, (s.ForwardPass, s.BackwardPass))
        ]
        forwards = [b for kind, b in order if kind == "ForwardPass"]
        backwards = [b for kind, b in order if kind == "BackwardPass"]
        assert len(forwards) == len(backwards) == micro
        in_flight = peak = 0
        for kind, _ in order:
            in_flight += 1 if kind == "ForwardPass" else -1
            assert in_flight >= 0  # a backward never precedes its forward
            peak = max(peak, in_flight)
        assert peak <= sched.num_pipe_buffers()  # 1F1B: at most stages - stage forwards in flight
        assert [type(c) for c in steps[-1][-3:]] == [s.ReduceTiedGrads, s.ReduceGrads, s.OptimizerStep]
        kinds = {type(c) for cmds in steps for c in cmds}
        assert (s.SendActivation in kinds) == (stage < stages - 1)
        assert (s.RecvGrad in kinds) == (stage < stages - 1)
        assert (s.RecvActivation in kinds) == (stage > 0)


def test_inference_and_data_parallel_schedules() -> None:
    inf = s.InferenceSchedule(micro_batches=3, stages=2, stage_id=1)
    steps = list(inf)
    assert len(steps) == 4 and steps[0] == [] and inf.num_pipe_buffers() == 2
    assert sum(isinstance(c, s.ForwardPass) for cmds in steps for c in cmds) == 3
    dp = list(s.DataParallelSchedule(micro_batches=2, stages=1, stage_id=0))
    assert [type(c) for c in dp[-1]] == [
        s.LoadMicroBatch,
        s.ForwardPass,
        s.BackwardPass,
        s.ReduceGrads,
        s.OptimizerStep,
    ]
    assert repr(s.ForwardPass(3)) == "ForwardPass(buffer_id=3)"


def test_schedule_choice_and_chunk_placement() -> None:
    assert executor.check_schedule("1f1b", 1).cls.__name__ == "Schedule1F1B"
    with pytest.raises(ValueError, match="virtual_stages to 2 or more"):
        executor.check_schedule("interleaved_1f1b", 1)
    with pytest.raises(ValueError, match="runs 2 stage"):
        executor.check_schedule("zbv_zero_bubble", 3)
    with pytest.raises(ValueError, match="runs 1 stage"):
        executor.check_schedule("gpipe", 2)
    loop = executor.check_schedule("interleaved_1f1b", 3)
    assert executor.chunk_stages(loop, 1, 4, 3) == [1, 5, 9]
    vee = executor.check_schedule("dualpipev", 2)
    assert executor.chunk_stages(vee, 0, 4, 2) == [0, 7] and executor.chunk_stages(vee, 3, 4, 2) == [3, 4]


def test_config_names_the_schedules() -> None:
    cfg = load_config(
        {"train_batch_size": 4, "pipeline": {"schedule": "zbv_zero_bubble", "virtual_stages": 2}}
    )
    assert cfg.config.pipeline.schedule == "zbv_zero_bubble"
    with pytest.raises(ConfigError, match=r"pipeline\.schedule"):
        load_config({"train_batch_size": 4, "pipeline": {"schedule": "zb1p"}})
    assert sorted(executor.SCHEDULES) == sorted(
        [
            "1f1b",
            "gpipe",
            "interleaved_1f1b",
            "looped_bfs",
            "interleaved_zero_bubble",
            "zbv_zero_bubble",
            "dualpipev",
        ]
    )

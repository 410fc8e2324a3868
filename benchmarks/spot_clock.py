"""One clock for every system in a compressed spot replay: each configured wait of Elastron and of Ray
Train v2 is its default divided by the compression, above a stated floor, by the same rule.

Two kinds of wait, two floors:
- intervals and patience (a poll, a monitor interval, a settle time, a tick): default / compression, at
  least `interval_floor_s`; on this box a loop polling faster than that only adds load;
- timeouts that bound real work, which the compression does not shorten (a process start, a placement,
  a health check): default / compression, at least the smaller of the default and `timeout_floor_s`,
  since a start on the shared 2-core box takes seconds of real time whatever the replay's clock.

Ray Train v2 as its documentation advises for elastic training on spot instances:
`ScalingConfig(num_workers=(min, max))` with `elastic_resize_monitor_interval_s`, unlimited
`FailureConfig(max_failures=-1)`, and the train loop's just-in-time checkpoint on
`ray.train.get_preemption_info()`. Its public knobs are the scaling config and the RAY_TRAIN_* variables;
the autoscaling coordinator's 20 s tick and the train client's 20 s request interval are constants in
Ray's source with no knob, which `ray_worker_setup` (a `worker_process_setup_hook`) sets for the same
clock in every Ray worker process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ELASTRON_INTERVALS = {"settle_seconds": 10.0, "poll_interval_s": 0.5, "chunk_seconds": 0.5,
                      "reprobe_interval_s": 3.0, "suspect_seconds": 60.0, "restart_window_s": 600.0}
"""service.control.options.CoordinatorOptions' defaults that are intervals or patience."""
ELASTRON_TIMEOUTS = {"start_timeout_s": 30.0, "probe_timeout_s": 2.0}
"""... and those that bound real work."""
RAY_INTERVALS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": 2.0, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": 5.0}
RAY_TIMEOUTS = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": 60.0, "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": 600.0}
RAY_MONITOR_INTERVAL_S = 60.0
"""ScalingConfig.elastic_resize_monitor_interval_s' default."""
RAY_INTERNAL_INTERVALS = {"autoscaling_coordinator_tick_s": 20.0, "autoscaling_request_interval_s": 20.0}
"""Constants in Ray 2.60's source (`_AutoscalingCoordinatorActor.TICK_INTERVAL_S`,
`autoscaling_coordinator_client.AUTOSCALING_REQUESTS_INTERVAL_S`)."""
_HOOK_ENV = {"autoscaling_coordinator_tick_s": "SPOT_CLOCK_RAY_TICK_S",
             "autoscaling_request_interval_s": "SPOT_CLOCK_RAY_REQUEST_INTERVAL_S"}


@dataclass(frozen=True, slots=True)
class Clock:
    compression: float
    """Trace seconds per wall second."""
    interval_floor_s: float = 0.5
    timeout_floor_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.compression >= 1:
            raise ValueError(f"compression must be >= 1 (trace seconds per wall second), got {self.compression}")
        if not (self.interval_floor_s > 0 and self.timeout_floor_s > 0):
            raise ValueError(f"floors must be > 0 s, got {self.interval_floor_s} and {self.timeout_floor_s}")

    def interval(self, default_s: float) -> float:
        return float(round(max(self.interval_floor_s, default_s / self.compression), 3))

    def timeout(self, default_s: float) -> float:
        return float(round(max(min(default_s, self.timeout_floor_s), default_s / self.compression), 3))

    def elastron(self) -> dict[str, float]:
        """CoordinatorOptions fields for this clock."""
        return ({k: self.interval(v) for k, v in ELASTRON_INTERVALS.items()}
                | {k: self.timeout(v) for k, v in ELASTRON_TIMEOUTS.items()})

    def ray_env(self) -> dict[str, str]:
        """RAY_TRAIN_* variables (Ray Train propagates them from the driver to its controller and
        workers) and the hook's variables for Ray's internal constants."""
        env = {k: str(self.interval(v)) for k, v in RAY_INTERVALS.items()}
        env |= {k: str(self.timeout(v)) for k, v in RAY_TIMEOUTS.items()}
        env |= {_HOOK_ENV[k]: str(self.interval(v)) for k, v in RAY_INTERNAL_INTERVALS.items()}
        return env

    def ray_monitor_interval_s(self) -> float:
        return self.interval(RAY_MONITOR_INTERVAL_S)

    def record(self) -> dict:
        """Every setting, its default and the rule, for the results JSON."""
        def rows(table: dict, rule) -> dict:
            return {k: {"default_s": v, "set_s": rule(v)} for k, v in table.items()}

        return {"compression": self.compression, "interval_floor_s": self.interval_floor_s,
                "timeout_floor_s": self.timeout_floor_s,
                "rule": "interval: max(floor, default / compression); timeout bounding real work: "
                        "max(min(default, timeout floor), default / compression)",
                "elastron": rows(ELASTRON_INTERVALS, self.interval) | rows(ELASTRON_TIMEOUTS, self.timeout),
                "raytrain": rows(RAY_INTERVALS, self.interval) | rows(RAY_TIMEOUTS, self.timeout)
                | rows({"elastic_resize_monitor_interval_s": RAY_MONITOR_INTERVAL_S}, self.interval)
                | rows(RAY_INTERNAL_INTERVALS, self.interval),
                "notice_s": {"default_s": 120.0, "set_s": round(120.0 / self.compression, 3)}}


def ray_worker_setup() -> None:
    """`worker_process_setup_hook` for every Ray worker process of the replay: Ray's internal autoscaling
    intervals on the replay's clock, from the variables `Clock.ray_env` sets (absent: Ray's own)."""
    tick = os.environ.get(_HOOK_ENV["autoscaling_coordinator_tick_s"])
    req = os.environ.get(_HOOK_ENV["autoscaling_request_interval_s"])
    if tick:
        from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as dac

        dac._AutoscalingCoordinatorActor.TICK_INTERVAL_S = float(tick)
    if req:
        from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as acc

        acc.AUTOSCALING_REQUESTS_INTERVAL_S = float(req)

"""Autoscaling the STT and TTS on slot occupancy (docs/scaling.md, "Autoscaling on slots").

Serve's default policy counts ongoing requests, which says little here: an STT turn or a TTS
clause holds one of the engine's ``num_slots`` slots for its whole length, however many calls it
makes. So each STT and TTS replica reports its slots in use and its slot count as Ray Serve
custom autoscaling metrics (its ``record_autoscaling_stats`` method, which the replica polls only
while the deployment has an ``autoscaling_config``), and :class:`SlotPolicy`, named as that
config's ``policy.policy_function``, turns them into a replica count with :func:`decide`.

Only the standard library here: Serve's controller imports this module when it applies the
yaml (Ray 2.60: ``AutoscalingPolicy.serialize_policy``, from ``override_deployment_info``), and
the build task pickles it by value for the controller to load later; neither should pull torch
or the engines into the controller.
"""
from __future__ import annotations

import math
import time

IN_USE, SLOTS = "slots_in_use", "slots"  # the metric names a replica reports
LOW_SINCE = "gapless_low_since"  # policy_state key: when occupancy went below scale_down_below


def slot_stats(in_use: int, slots: int) -> dict[str, int]:
    """What a replica's ``record_autoscaling_stats`` returns."""
    return {IN_USE: int(in_use), SLOTS: int(slots)}


def decide(snapshots: list[tuple[float, float]], running: int, target: int, now: float,
           low_since: float | None, *, scale_up_at: float, scale_down_below: float,
           scale_down_after_s: float, min_replicas: int, max_replicas: int) -> tuple[int, float | None]:
    """The replica count, and when occupancy went low (None while it is not low).

    ``snapshots``: (slots in use, slots) of each replica that has reported; ``running``: replicas
    Serve runs now (one with no report yet is new: counted empty, with the others' slot count);
    ``target``: the count Serve is already heading for, replicas still starting included."""
    def bounded(n: int) -> int:
        return max(min_replicas, min(max_replicas, n))

    if not snapshots:  # nothing reported yet: no grounds for a change
        return bounded(target), None
    per_replica = sum(slots for _, slots in snapshots) / len(snapshots)
    in_use = sum(used for used, _ in snapshots)
    occupancy = in_use / (per_replica * max(running, len(snapshots)))
    if occupancy > scale_up_at:  # enough replicas to bring it back to scale_up_at, at once
        return bounded(max(target, math.ceil(in_use / (scale_up_at * per_replica)))), None
    if occupancy >= scale_down_below:  # the band: hold
        return bounded(target), None
    low_since = now if low_since is None else low_since
    if now - low_since >= scale_down_after_s:  # low for long enough: one fewer, then wait again
        return bounded(target - 1), None
    return bounded(target), low_since


class SlotPolicy:
    """Serve's custom autoscaling policy over :func:`decide` (``policy_kwargs`` are its knobs).

    ``scale_down_below`` must be at most half of ``scale_up_at``: going from N replicas to N - 1
    multiplies occupancy by at most 2, so a step down never lands above the scale-up line."""

    def __init__(self, scale_up_at: float = 0.75, scale_down_below: float = 0.35,
                 scale_down_after_s: float = 300.0):
        if not 0 < scale_up_at <= 1 or not 0 <= scale_down_below <= scale_up_at / 2 or scale_down_after_s < 0:
            raise ValueError("SlotPolicy needs 0 < scale_up_at <= 1, 0 <= scale_down_below <= scale_up_at / 2 and "
                             f"scale_down_after_s >= 0; got {scale_up_at}, {scale_down_below}, {scale_down_after_s}")
        self.scale_up_at, self.scale_down_below = scale_up_at, scale_down_below
        self.scale_down_after_s = scale_down_after_s

    def __call__(self, ctx) -> tuple[int, dict]:
        """``ctx``: ``ray.serve.config.AutoscalingContext``; its ``aggregated_metrics`` hold each
        metric per running replica, averaged over ``look_back_period_s``."""
        metrics = ctx.aggregated_metrics or {}
        in_use, slots = metrics.get(IN_USE, {}), metrics.get(SLOTS, {})
        snapshots = [(in_use[r], slots[r]) for r in slots if r in in_use and slots[r] > 0]
        state = dict(ctx.policy_state or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        count, state[LOW_SINCE] = decide(
            snapshots, ctx.current_num_replicas, ctx.target_num_replicas, now, state.get(LOW_SINCE),
            scale_up_at=self.scale_up_at, scale_down_below=self.scale_down_below,
            scale_down_after_s=self.scale_down_after_s, min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas)
        return count, state

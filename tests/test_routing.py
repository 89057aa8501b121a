"""Sticky, stable canary routing."""

import subprocess
import sys
from pathlib import Path

import pytest

from templates.routing import BUCKETS, DEFAULT_RAMP, Canary, bucket, takes_canary

KEYS = [f"user-{i}" for i in range(20_000)]


@pytest.mark.parametrize("share", [0.0, 0.01, 0.05, 0.20, 0.5, 1.0])
def test_the_canary_gets_its_share_of_keys_within_one_point(share):
    # 20,000 keys: the binomial standard deviation of the share is at most 0.35 points; allow 1 point.
    routed = sum(takes_canary("risk", key, share) for key in KEYS) / len(KEYS)
    assert routed == pytest.approx(share, abs=0.01)


def test_buckets_spread_evenly():
    counts = [0] * 10
    for key in KEYS:
        counts[bucket("risk", key) * 10 // BUCKETS] += 1
    assert all(abs(c - 2_000) < 200 for c in counts), counts


def test_a_key_always_gets_the_same_route():
    first = [takes_canary("risk", key, 0.2) for key in KEYS[:1000]]
    again = [takes_canary("risk", key, 0.2) for key in KEYS[:1000]]
    assert first == again


def test_routing_is_the_same_in_another_process():
    # Python's hash() is salted per process; the bucket must not be.
    code = "from templates.routing import bucket; print([bucket('risk', f'user-{i}') for i in range(50)])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.stdout.strip() == str([bucket("risk", f"user-{i}") for i in range(50)])


def test_tasks_route_independently():
    same = sum(takes_canary("risk", key, 0.5) == takes_canary("summarize", key, 0.5) for key in KEYS)
    assert abs(same / len(KEYS) - 0.5) < 0.02


def test_raising_the_share_only_adds_keys():
    at_5 = {key for key in KEYS if takes_canary("risk", key, 0.05)}
    at_20 = {key for key in KEYS if takes_canary("risk", key, 0.20)}
    assert at_5 < at_20


def test_the_ramp_advances_step_by_step_and_stops_at_the_end():
    canary = Canary(version_id=7, share=DEFAULT_RAMP[0])
    shares = [canary.share]
    while canary.share < 1.0:
        canary = canary.advance()
        shares.append(canary.share)
    assert shares == [0.05, 0.20, 1.0]
    assert canary.version_id == 7
    with pytest.raises(ValueError, match="promote version 7 to end it"):
        canary.advance()


def test_advance_from_a_share_between_steps_goes_to_the_next_step():
    assert Canary(3, 0.1, (0.05, 0.2, 1.0)).advance().share == 0.2


@pytest.mark.parametrize(
    "share, ramp",
    [(-0.1, DEFAULT_RAMP), (1.5, DEFAULT_RAMP), (0.05, ()), (0.05, (0.2, 0.05)), (0.05, (0.05, 0.05)), (0.05, (0, 1))],
)
def test_bad_canary_settings_are_refused(share, ramp):
    with pytest.raises(ValueError, match="share|ramp"):
        Canary(1, share, ramp)

"""How the virtual clock moves, as asyncio's loop moves it (clock.py's VirtualTimeLoop) and as the
plain simulated loop does the same without one (virtual_run.py). No asyncio here: a simulated
open-loop run never loads it (about 20 ms of the simulated hour's start)."""

from __future__ import annotations

import math

# asyncio's longest wait for a timer (asyncio.base_events.MAXIMUM_SELECT_TIMEOUT, a day; tests
# hold the two equal)
MAX_WAIT_S = 24 * 3600


def resolution_s(now_s: float) -> float:
    """The virtual loop's clock resolution at `now_s`: a timer due before now + this fires now."""
    return max(1e-9, 2 * math.ulp(now_s))


def waited_s(now_s: float, timeout_s: float, capped_at_s: float | None) -> float:
    """Where the virtual clock lands after a wait of `timeout_s` (asyncio's, up to the first
    timer); `capped_at_s`: that timer, when asyncio capped the wait at MAX_WAIT_S."""
    return max(now_s + max(timeout_s, 0.0), capped_at_s or 0.0)

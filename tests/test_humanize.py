"""Numbers as people read them: each unit is picked on the printed (rounded) value."""
from __future__ import annotations

import pytest

from pilotrun.humanize import human_seconds


@pytest.mark.parametrize("seconds, shown", [
    (None, "n/a"), (2e-7, "< 1 µs"), (3.4e-5, "34 µs"), (0.0004, "400 µs"), (0.0009996, "1 ms"), (0.42, "420 ms"), (0.9994, "999 ms"),
    (0.9996, "1.00 s"), (1.0, "1.00 s"),  # was "1000 ms"
    (9.994, "9.99 s"), (9.996, "10.0 s"), (119.94, "119.9 s"), (119.96, "2.0 min"),
    (600, "10.0 min"), (7196, "119.9 min"), (7198, "2.0 h"), (36000, "10.0 h"),
])
def test_human_seconds_never_prints_a_unit_at_its_own_limit(seconds, shown):
    assert human_seconds(seconds) == shown

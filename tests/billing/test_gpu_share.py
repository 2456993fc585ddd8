"""A board cut into parts (MIG slices, time-sliced pods) counts once as GPU time."""

from __future__ import annotations

import pytest

from billing.ledger import Ledger
from tests.billing.conftest import batch, gpu_samples
from tests.billing.test_ingest import NOW


def test_a_samples_share_of_the_board_is_the_gpu_time_it_counts(ledger: Ledger) -> None:
    """An hour of a 3/7 MIG slice and of two pods sharing a board: 3/7 h and 1 h, not 3 h."""
    mig = [s | {"share": 3 / 7, "gpu": "0/1", "mig_profile": "3g.40gb"} for s in gpu_samples()]
    pod_a = [s | {"share": 0.5, "gpu": "1", "replica": "small-0"} for s in gpu_samples(gpu="1")]
    pod_b = [s | {"share": 0.5, "gpu": "1", "replica": "small-1"} for s in gpu_samples(gpu="1")]
    result = ledger.ingest(batch("gpu_samples", mig + pod_a + pod_b), now=NOW)
    assert result.accepted == 3 * 360
    with ledger.reader() as cur:
        rows = dict(
            cur.execute(
                "SELECT replica || ':' || (slot >= 0), sum(gpu_seconds) FROM gpu_slots GROUP BY ALL"
            ).fetchall()
        )
        sums = cur.execute(
            "SELECT sum(gpu_seconds), sum(utilization_seconds) / sum(gpu_seconds) FROM gpu_slots"
        ).fetchone()
    assert sums is not None
    total, utilization = sums
    assert rows["small-0:true"] == pytest.approx(3600 * 3 / 7 + 1800)
    assert rows["small-1:true"] == pytest.approx(1800)
    assert total == pytest.approx(3600 * 3 / 7 + 3600)
    assert utilization == pytest.approx(0.5)


def test_a_share_outside_the_board_counts_no_more_than_the_board(ledger: Ledger) -> None:
    """A sample claiming more than its board (or less than nothing) is held to [0, 1]."""
    over = [s | {"share": 4.0} for s in gpu_samples(seconds=60)]
    under = [s | {"share": -1.0, "gpu": "1"} for s in gpu_samples(seconds=60, gpu="1")]
    ledger.ingest(batch("gpu_samples", over + under), now=NOW)
    with ledger.reader() as cur:
        row = cur.execute("SELECT sum(gpu_seconds) FROM gpu_slots").fetchone()
    assert row is not None
    assert row[0] == pytest.approx(60.0)

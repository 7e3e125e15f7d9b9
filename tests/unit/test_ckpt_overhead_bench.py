"""bench/ckpt_overhead.py's arithmetic and table (the measurements run on real Ray)."""

from __future__ import annotations

import pytest

from bench.ckpt_overhead import _mlp, ratios, render

pytestmark = pytest.mark.timeout(60)

SIZES = [
    {
        "state_mb": 250.0,
        "step_s": {"none": 1.0, "replicas=1": 1.02, "replicas=2": 1.05, "torch.save": 2.0},
        "restore": {
            "memory": {"restore_s": 0.1},
            "peer": {"restore_s": 0.4},
            "durable": {"restore_s": 4.0},
        },
    }
]


def test_overheads_are_relative_to_no_checkpoint_and_restores_to_peer():
    [row] = ratios(SIZES)
    assert row["replicas=2 overhead"] == pytest.approx(0.05)
    assert row["torch.save overhead"] == pytest.approx(1.0)
    assert row["durable/peer restore"] == pytest.approx(10.0)
    assert "none overhead" not in row


def test_table_shows_missing_figures_as_dashes():
    text = render({"sizes": SIZES, "ratios": ratios(SIZES)})
    assert "250" in text and "-" in text and "+5.0%" in text and "10.0x" in text


def test_the_model_holds_about_the_asked_state():
    model = _mlp(25.0, 512)
    params = sum(p.numel() for p in model.parameters())
    assert 0.8 * 25e6 / 12 < params < 1.25 * 25e6 / 12

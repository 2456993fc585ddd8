"""The fast exposition reader agrees with prometheus-client and refuses garbage."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.dcgm import DCGM_FIELDS
from collectors.exposition import ExpositionError, parse_samples
from collectors.vllm import VLLM_FIELDS


def _library(text: str, wanted: tuple[str, ...]) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name in wanted}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # The library names counter samples <family>_total; match them to the written name.
            name = s.name if s.name in out else s.name.removesuffix("_total")
            if name in out:
                out[name].append((s.labels, s.value))
    return out


@pytest.mark.parametrize(
    ("capture", "wanted"),
    [("dcgm-exporter-rtx4000ada-k8s.prom", DCGM_FIELDS), ("vllm-0.32-metrics.prom", VLLM_FIELDS)],
)
def test_agrees_with_prometheus_client_on_real_captures(fixture_text, capture, wanted):
    """Every wanted sample, labels and value, is what prometheus-client reads."""
    text = fixture_text(capture)
    ours = parse_samples(text, wanted)
    assert ours == _library(text, wanted)
    assert all(ours[name] for name in wanted)


def test_escaped_label_values_and_timestamps_are_read():
    """Quotes, backslashes and newlines in label values unescape; a timestamp is ignored."""
    text = 'm{a="x\\"y",b="c\\\\d\\ne"} 1.5 1700000000000\n'
    assert parse_samples(text, ["m"]) == {"m": [({"a": 'x"y', "b": "c\\d\ne"}, 1.5)]}


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>\n",
        'DCGM_FI_DEV_GPU_UTIL{gpu="0" 5\n',
        'DCGM_FI_DEV_GPU_UTIL{gpu="0"} five\n',
        "not a metric line at all\n",
    ],
)
def test_garbage_is_refused(text):
    """Anything that is not the text format raises ExpositionError naming the line."""
    with pytest.raises(ExpositionError, match="line 1"):
        parse_samples(text, DCGM_FIELDS)

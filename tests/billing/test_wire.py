"""The shippers' Arrow format: typed columns that round-trip, and a schema billing checks."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from infermeter.records import GPU, KINDS, USAGE
from infermeter.wire import arrow_extent, arrow_schema, decode_arrow, encode_arrow
from tests.billing.conftest import gpu_samples, ndjson, usage


def test_lines_round_trip_through_arrow_unchanged():
    """Every field of every record comes back with its value and the kind's type."""
    records = [usage(), usage(team="assistant", prompt_tokens=7, first_token_at=None)]
    encoded = encode_arrow(USAGE, ndjson(records))
    assert encoded is not None
    table = decode_arrow(USAGE, encoded)
    assert table.schema.equals(arrow_schema(USAGE))
    assert table.to_pylist() == [{f.name: r[f.name] for f in USAGE.fields} for r in records]


def test_samples_have_an_arrow_form_too():
    """GPU samples convert as well (the collector ships them the same way)."""
    samples = [
        dict(s, xid_errors=0, mig_profile=None, gap=False, share=1.0)
        for s in gpu_samples(seconds=30)
    ]
    encoded = encode_arrow(GPU, ndjson(samples))
    assert encoded is not None
    assert decode_arrow(KINDS["gpu_samples"], encoded).num_rows == 3


@pytest.mark.parametrize(
    "odd",
    [
        {"prompt_tokens": "1"},
        {"prompt_tokens": 1.0},
        {"stream": 1},
        {"colour": "red"},
        {"team": None},
    ],
)
def test_lines_that_do_not_convert_exactly_stay_ndjson(odd: dict[str, Any]) -> None:
    """No coercion on the shipper's side either: such a batch is sent as NDJSON."""
    assert encode_arrow(USAGE, ndjson([usage(), usage() | odd])) is None


def _stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def test_a_stream_of_another_schema_is_refused_naming_it():
    """An int32 where billing keeps int64: ValueError with both schemas, nothing converted."""
    encoded = encode_arrow(USAGE, ndjson([usage()]))
    assert encoded is not None
    table = decode_arrow(USAGE, encoded)
    narrowed = table.set_column(
        table.schema.get_field_index("prompt_tokens"),
        "prompt_tokens",
        table.column("prompt_tokens").cast(pa.int32()),
    )
    with pytest.raises(ValueError, match=r"prompt_tokens: int32.*expected.*prompt_tokens: int64"):
        decode_arrow(USAGE, _stream(narrowed))


def test_a_null_where_none_is_allowed_is_refused():
    """Nulls cannot be told from absent fields in Arrow: the batch must come as NDJSON."""
    encoded = encode_arrow(USAGE, ndjson([usage()]))
    assert encoded is not None
    table = decode_arrow(USAGE, encoded)
    nulled = table.set_column(
        table.schema.get_field_index("team"), "team", pa.array([None], pa.string())
    )
    with pytest.raises(ValueError, match="team: null"):
        decode_arrow(USAGE, _stream(nulled))


def test_a_body_that_is_not_arrow_is_refused():
    """Garbage with the Arrow content type: a clear ValueError (the API answers 400)."""
    with pytest.raises(ValueError, match="not an Arrow IPC stream"):
        decode_arrow(USAGE, b'{"usage": []}')


@pytest.mark.parametrize("garbage", [b"\xf0\xff\xff\xff", b"\xff\xff\xff\xff\xff\xff\xff\xff"])
def test_a_stream_header_pyarrow_reads_as_an_io_error_is_refused_too(garbage: bytes) -> None:
    """A negative continuation token or metadata length is the same ValueError, not a fault."""
    with pytest.raises(ValueError, match="not an Arrow IPC stream"):
        decode_arrow(USAGE, garbage)


@pytest.mark.parametrize("compression", ["zstd", None])
def test_the_extent_of_a_stream_is_read_only_up_to_the_first_batch_past_a_limit(compression):
    """Records and decoded bytes are summed batch by batch until a limit is passed, compressed or not."""
    encoded = encode_arrow(USAGE, ndjson([usage() for _ in range(10)]))
    assert encoded is not None
    one = pa.ipc.open_stream(encoded).read_all().to_batches()[0]
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, one.schema, options=options) as writer:
        for _ in range(5):
            writer.write_batch(one)
    stream = sink.getvalue().to_pybytes()
    records, size = arrow_extent(stream, 1000, 1 << 30)
    assert records == 50
    assert one.nbytes * 5 <= size <= (one.nbytes + 64 * one.num_columns) * 5
    assert arrow_extent(stream, 15, 1 << 30) == (20, size * 2 // 5)
    assert arrow_extent(stream, 1000, size // 5) == (20, size * 2 // 5)
    assert arrow_extent(b"not arrow", 10, 10) == (0, 0)

"""The ingest wire formats a shipper may send, and their strict readers.

Records leave a sidecar's or collector's spool as NDJSON lines. Reading JSON is most of what a
central billing service would spend per record (``python -m bench.billing_scale
--breakdown``), so the shipper, which has the lines at hand and a whole fleet's CPUs between
its copies, turns each batch into an Arrow IPC stream first (typed columns, compressed with
zstd) and billing only checks its schema. Both conversions are strict: Arrow's JSON reader,
given the kind's schema, refuses unknown keys and every type mismatch (a string or boolean
for a number, a fraction for an integer) instead of converting.

The Arrow schema is derived from the record kinds (``infermeter.records``), so the shipper
and billing agree on it by construction.

A batch that does not convert exactly (a bad type, a missing field, a line that is not one JSON
object) is sent as NDJSON instead, and billing's per-record path names each bad record.
"""

from __future__ import annotations

import struct
from functools import cache
from typing import Final

import pyarrow as pa
import pyarrow.json as pa_json

from infermeter.records import FieldType, RecordKind

__all__ = [
    "ARROW_STREAM",
    "NDJSON",
    "arrow_extent",
    "arrow_schema",
    "decode_arrow",
    "encode_arrow",
    "line_count",
    "read_ndjson",
]

ARROW_STREAM: Final = "application/vnd.apache.arrow.stream"
NDJSON: Final = "application/x-ndjson"

_ARROW: Final = {
    FieldType.STRING: pa.string(),
    FieldType.INT: pa.int64(),
    FieldType.NUMBER: pa.float64(),
    FieldType.BOOL: pa.bool_(),
}
# One thread per batch: concurrent requests already keep the cores busy, so Arrow's own
# threads would only add their coordination to the same work.
_READ: Final = pa_json.ReadOptions(use_threads=False, block_size=4 << 20)
_WRITE: Final = pa.ipc.IpcWriteOptions(compression="zstd")


@cache
def arrow_schema(kind: RecordKind) -> pa.Schema:
    """The kind's record as Arrow columns, in the order of its fields."""
    return pa.schema([pa.field(f.name, _ARROW[f.type]) for f in kind.fields])


@cache
def _parse_options(kind: RecordKind) -> pa_json.ParseOptions:
    return pa_json.ParseOptions(
        explicit_schema=arrow_schema(kind), unexpected_field_behavior="error"
    )


def line_count(body: bytes) -> int:
    """Records in an NDJSON body: its lines, the last one with or without a newline."""
    if not body:
        return 0
    return body.count(b"\n") + (0 if body.endswith(b"\n") else 1)


def read_ndjson(kind: RecordKind, body: bytes, lines: int | None = None) -> pa.Table | None:
    """An NDJSON batch as the kind's columns, or None unless every record fits exactly.

    None also when the records are not exactly one per line (Arrow's reader would take an
    object spread over lines, or two on one line, and skips blank lines), and when a field
    that may not be null is null or absent in any record: the per-record path tells "missing"
    from "null" and fills defaults for absent fields only. ``lines``: ``line_count(body)``, when
    the caller has counted already.
    """
    lines = line_count(body) if lines is None else lines
    if not lines or not _one_object_per_line(body, lines):
        return None
    try:
        table = pa_json.read_json(
            pa.py_buffer(body), read_options=_READ, parse_options=_parse_options(kind)
        )
    except (pa.ArrowException, ValueError):
        return None
    if table.num_rows != lines or _null_field(kind, table) is not None:
        return None
    return table


def _one_object_per_line(body: bytes, lines: int) -> bool:
    """Every line starts with ``{`` and no carriage return is anywhere (Arrow ends a line at one).

    Arrow's reader must never see a line whose value is not an object: pyarrow 26 crashes the
    process (a segmentation fault, not an exception) on a body that starts with ``null``.
    Records as a spool writes them always pass; anything else takes the per-record path, which
    names what is wrong.
    """
    return body.startswith(b"{") and body.count(b"\n{") == lines - 1 and b"\r" not in body


def encode_arrow(kind: RecordKind, body: bytes) -> bytes | None:
    """NDJSON lines of ``kind`` as a zstd-compressed Arrow IPC stream, or None (send NDJSON)."""
    table = read_ndjson(kind, body)
    if table is None:
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_WRITE) as writer:
        writer.write_table(table)
    encoded: bytes = sink.getvalue().to_pybytes()
    return encoded


def arrow_extent(body: bytes, max_records: int, max_bytes: int) -> tuple[int, int]:
    """Records and decoded bytes of an Arrow IPC stream, read one message at a time.

    Nothing is decompressed: each record batch's message header holds its row count and its
    buffers' places, and each compressed buffer starts with its decompressed length. Reading
    stops at the first batch that takes either total past its limit, so totals over a limit
    are only "at least". A stream that is small compressed and huge decoded (a zstd bomb) is
    measured at the cost of reading its headers. A body that is not a stream counts what was
    read before the fault; ``decode_arrow`` says what is wrong with it.
    """
    records = size = 0
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(body))
        while records <= max_records and size <= max_bytes:
            message = reader.read_next_message()
            rows, decoded = _batch_extent(message.metadata, message.body)
            records += rows
            size += decoded
    except (StopIteration, pa.ArrowException, ValueError, OSError, struct.error):
        pass
    return records, size


# Flatbuffers field ids of Arrow's Message.fbs: Message.header_type, .header; DictionaryBatch
# .data; RecordBatch .length, .buffers, .compression; the header types of a batch.
_HEADER_TYPE, _HEADER, _DICTIONARY_DATA = 1, 2, 1
_LENGTH, _BUFFERS, _COMPRESSION = 0, 2, 3
_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3


def _batch_extent(meta: pa.Buffer, body: pa.Buffer | None) -> tuple[int, int]:
    """Rows and decompressed body bytes of one IPC message (0, 0 for a schema)."""
    message = _table(meta, _ref(meta, 0))
    kind = meta[message.at(_HEADER_TYPE)] if message.at(_HEADER_TYPE) else 0
    if kind not in (_DICTIONARY_BATCH, _RECORD_BATCH) or not message.at(_HEADER):
        return 0, 0
    header = _table(meta, _ref(meta, message.at(_HEADER)))
    if kind == _DICTIONARY_BATCH:
        if not header.at(_DICTIONARY_DATA):
            return 0, 0
        header = _table(meta, _ref(meta, header.at(_DICTIONARY_DATA)))
    rows = struct.unpack_from("<q", meta, header.at(_LENGTH))[0] if header.at(_LENGTH) else 0
    if not header.at(_BUFFERS):
        return max(rows, 0), 0
    buffers = _ref(meta, header.at(_BUFFERS))
    compressed = bool(header.at(_COMPRESSION)) and body is not None
    size = 0
    for i in range(struct.unpack_from("<I", meta, buffers)[0]):
        offset, length = struct.unpack_from("<qq", meta, buffers + 4 + 16 * i)
        if offset < 0 or length < 0:
            raise ValueError("a buffer with a negative offset or length")
        if compressed and length >= 8:
            # A compressed buffer is its decompressed length (-1: stored as is), then the data.
            raw = struct.unpack_from("<q", body, offset)[0]  # type: ignore[arg-type]
            size += length - 8 if raw == -1 else max(raw, 0)
        else:
            size += length
    return max(rows, 0), size


class _Table:
    """A flatbuffers table: its position, and where each field is (0: absent)."""

    def __init__(self, position: int, fields: list[int]) -> None:
        self.position = position
        self.fields = fields

    def at(self, field: int) -> int:
        """The position of ``field``'s value, or 0 when the table does not have it."""
        offset = self.fields[field] if field < len(self.fields) else 0
        return self.position + offset if offset else 0


def _table(buf: pa.Buffer, position: int) -> _Table:
    vtable = position - struct.unpack_from("<i", buf, position)[0]
    vtable_size = struct.unpack_from("<H", buf, vtable)[0]
    count = max(vtable_size - 4, 0) // 2
    return _Table(position, list(struct.unpack_from(f"<{count}H", buf, vtable + 4)))


def _ref(buf: pa.Buffer, position: int) -> int:
    target: int = position + struct.unpack_from("<I", buf, position)[0]
    return target


def decode_arrow(kind: RecordKind, body: bytes) -> pa.Table:
    """An Arrow IPC stream of ``kind`` records; ValueError naming what does not match."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        # Reading checks the messages' framing only: a batch whose offsets point outside its
        # buffers, or whose strings are not UTF-8, is read as it is, and touching it later
        # crashes the process. Full validation checks every offset and every string.
        table.validate(full=True)
    # Some malformed streams ("negative continuation token") are a plain OSError.
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise ValueError(f"the body is not an Arrow IPC stream: {exc}") from None
    expected = arrow_schema(kind)
    if not table.schema.equals(expected):
        got = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
        want = ", ".join(f"{f.name}: {f.type}" for f in expected)
        raise ValueError(
            f"the Arrow schema does not match {kind.key}: got ({got}); expected ({want})"
        )
    missing = _null_field(kind, table)
    if missing is not None:
        raise ValueError(
            f"{missing}: null in an Arrow batch (send NDJSON to have records checked one by one)"
        )
    return table


def _null_field(kind: RecordKind, table: pa.Table) -> str | None:
    """The first field that may not be null but is, in some record."""
    for f in kind.fields:
        if not f.nullable and table.column(f.name).null_count:
            return f.name
    return None

"""The protobuf wire format, enough to read and rewrite XLA's dumped protos without generated classes.

XLA dumps programs as serialized ``xla.HloProto`` (``--xla_dump_hlo_as_proto``);
the scripts read a few fields of it by number (hlo.proto, xla_data.proto).
Field numbers stay with the code that reads them.
"""

from __future__ import annotations

from collections.abc import Iterator


def varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def fields(message: bytes) -> Iterator[tuple[int, int | bytes, bytes]]:
    """(field number, value, the field's raw bytes) of each field of one serialized message, in order.

    A varint field's value is an int; a length-delimited or fixed-width one's, its bytes.
    """
    pos = 0
    while pos < len(message):
        start = pos
        key, pos = varint(message, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(message, pos)
        elif wire == 2:
            size, pos = varint(message, pos)
            value, pos = message[pos:pos + size], pos + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = message[pos:pos + size], pos + size
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} (field {number}) at byte {start}")
        yield number, value, message[start:pos]


def message_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: an embedded message, bytes or a string."""
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def int_field(number: int, value: int) -> bytes:
    """A varint field (an int or an enum)."""
    return encode_varint(number << 3) + encode_varint(value)


def hlo_module_of(hlo_proto: bytes) -> bytes:
    """The ``hlo_module`` (field 1) of a serialized ``xla.HloProto``, as XLA dumps programs."""
    for number, value, _ in fields(hlo_proto):
        if number == 1:
            return value
    raise ValueError("the HloProto dump holds no hlo_module")

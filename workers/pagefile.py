"""The on-disk page file: a 4096-byte header, then the payload in canonical order.

Owns building and checking headers. Must not open files or know about pools.

Header (little endian; the rest of the 4096 bytes is zero):

    0   magic        8s   b"HICMPPG1"
    8   version      u32
    12  header_size  u32  (4096)
    16  payload_len  u64
    24  geometry_fp  16s  PageGeometry.fingerprint(): what the payload means
    40  key_digest   32s  sha256(namespace, key): whose page this is
    72  flags        u32  bit 0: payload_crc is set
    76  payload_crc  u32  zlib.crc32 of the payload, when flagged
    4092 header_crc  u32  zlib.crc32 of bytes [0, 4092)

The key is stored as its namespaced digest rather than verbatim: the digest is
what names the file, so checking it proves the file is this key's page under
this namespace, and it keeps completion records a fixed 64 bytes.
"""
import struct
import zlib

from . import status

MAGIC = b"HICMPPG1"
VERSION = 1
HEADER_SIZE = 4096
FLAG_PAYLOAD_CRC = 1

_FIELDS = struct.Struct("<8sIIQ16s32sII")
_CRC_AT = HEADER_SIZE - 4


def build_header(payload_len: int, geometry_fp: bytes, digest: bytes,
                 payload_crc: int | None = None) -> bytearray:
    header = bytearray(HEADER_SIZE)
    flags = FLAG_PAYLOAD_CRC if payload_crc is not None else 0
    _FIELDS.pack_into(header, 0, MAGIC, VERSION, HEADER_SIZE, payload_len, geometry_fp,
                      digest, flags, payload_crc or 0)
    struct.pack_into("<I", header, _CRC_AT, zlib.crc32(memoryview(header)[:_CRC_AT]))
    return header


def check_header(header, payload_len: int, geometry_fp: bytes, digest: bytes) -> tuple[int, int | None]:
    """(status, payload_crc or None) for a header read from a page file.

    Order matters: a damaged header is CORRUPT even if it happens to name
    another geometry, so the header checksum is verified first.
    """
    mv = memoryview(header)
    if len(mv) < HEADER_SIZE or bytes(mv[:8]) != MAGIC:
        return status.CORRUPT, None
    (stored_crc,) = struct.unpack_from("<I", mv, _CRC_AT)
    if zlib.crc32(mv[:_CRC_AT]) != stored_crc:
        return status.CORRUPT, None
    _, version, hsize, plen, fp, dig, flags, pcrc = _FIELDS.unpack_from(mv, 0)
    if version != VERSION or hsize != HEADER_SIZE or fp != geometry_fp or plen != payload_len:
        return status.FOREIGN, None
    if dig != digest:
        return status.WRONG_KEY, None
    return status.OK, (pcrc if flags & FLAG_PAYLOAD_CRC else None)


def payload_crc(views) -> int:
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc

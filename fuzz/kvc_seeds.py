#!/usr/bin/env python3
"""Writes the kvc_read seeds: small valid KVC files (server.md §4.4) with and without the
tool map and the integrity section, so the fuzzer starts past the header checks."""
import hashlib
import struct
import sys
from pathlib import Path

EXT_TOOL_MAP, EXT_INTEGRITY = 1, 8


def header(quant, reason, ext, tokens, hits, ctx, created, last, payload_len, key_len):
    return (b"KVC" + bytes([1, quant, reason, ext, 0])
            + struct.pack("<IIII", tokens, hits, ctx, 0)
            + struct.pack("<QQQI", created, last, payload_len, key_len))


def kvc(key, tokens, ext=0, tool_map=b"", quant=2):
    payload = b"FAKE" + struct.pack("<II", 1, len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens)
    if tool_map:
        ext |= EXT_TOOL_MAP
    h = header(quant, 1, ext, len(tokens), 3, 4096, 10, 20, len(payload), len(key))
    out = h + key + payload + tool_map
    if ext & EXT_INTEGRITY:
        # The checksum covers the header with hits, last used, bit0 and bit3 zeroed.
        fixed = header(quant, 1, ext & ~(EXT_TOOL_MAP | EXT_INTEGRITY), len(tokens), 0, 4096, 10, 0,
                       len(payload), len(key))
        digest = hashlib.sha256(fixed + key + payload).digest()
        out += b"KVI\x01" + b"ds4 fake engine fingerprint v1\0\0" + digest
    return out


def tool_map(entries):
    out = b"KTM\x01" + struct.pack("<I", len(entries))
    for ident, dsml in entries:
        out += struct.pack("<II", len(ident), len(dsml)) + ident + dsml
    return out


def main(dirname):
    d = Path(dirname)
    d.mkdir(parents=True, exist_ok=True)
    key = "<｜begin▁of▁sentence｜>You are helpful.".encode()
    tm = tool_map([(b"call_1", b"\n\n<\xef\xbd\x9cDSML\xef\xbd\x9ctool_calls>x")])
    seeds = {
        "reference.kv": kvc(key, [0, 5, 6, 7]),
        "reference_toolmap.kv": kvc(key, [0, 5, 6, 7], tool_map=tm),
        "integrity.kv": kvc(key, [0, 5, 6, 7, 8], ext=EXT_INTEGRITY, quant=4),
        "integrity_toolmap.kv": kvc(key, [0, 9], ext=EXT_INTEGRITY | 2, tool_map=tm),
    }
    for name, data in seeds.items():
        (d / name).write_bytes(data)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fuzz/seeds/kvc_read")

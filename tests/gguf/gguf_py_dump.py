#!/usr/bin/python3
"""Oracle for gguf_vocab_test: what llama.cpp's gguf-py reads from GGUF files.

Prints one JSON object {path: {"tensors": n, "fields": [...]}} where each field is
{"key", "type", "elem_type", "count", "crc"}: crc is zlib.crc32 over the values as GGUF encodes
them (strings as u64 length + bytes, numbers little-endian at their width, bools as one byte),
so the C++ test compares every value without trusting our own reader.
Usage: gguf_py_dump.py GGUF_PY_DIR FILE...
"""
import json
import struct
import sys
import zlib

sys.path.insert(0, sys.argv[1])
from gguf import GGUFReader, GGUFValueType  # noqa: E402


def encode(vtype, part):
    if vtype == GGUFValueType.STRING:
        raw = bytes(part)
        return struct.pack("<Q", len(raw)) + raw
    return part.tobytes()


out = {}
for path in sys.argv[2:]:
    reader = GGUFReader(path)
    fields = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue  # gguf-py's pseudo-fields for the header
        vtype = field.types[0]
        entry = {"key": field.name, "type": int(vtype)}
        if vtype == GGUFValueType.ARRAY:
            elem = field.types[1] if len(field.types) > 1 else None
            if elem == GGUFValueType.ARRAY:
                raise SystemExit(f"{path}: {field.name}: nested arrays are not handled by this oracle")
            items = b"".join(encode(elem, field.parts[i]) for i in field.data)
            entry.update(elem_type=int(elem) if elem is not None else -1, count=len(field.data), crc=zlib.crc32(items))
        else:
            entry.update(count=1, crc=zlib.crc32(encode(vtype, field.parts[field.data[0]])))
        fields.append(entry)
    out[path] = {"tensors": len(reader.tensors), "fields": fields}
json.dump(out, sys.stdout)

"""A CTranslate2 model.bin read back, written from its format (ctranslate2/specs/model_spec.py
``_serialize``, binary version 6): the variables as numpy arrays, by name, and the aliases. Read
independently of the export, to prove what it wrote."""
from __future__ import annotations

import struct

import numpy as np

#: the DataType order of ctranslate2/specs/model_spec.py (_dtype_to_type_id)
DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # None: bfloat16


def read(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    data = open(path, "rb").read()
    pos = 0

    def take(fmt):
        nonlocal pos
        values = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return values if len(values) > 1 else values[0]

    def string():
        nonlocal pos
        n = take("H")
        text = data[pos:pos + n - 1].decode("utf-8")
        pos += n
        return text

    take("I")  # binary version
    string()  # spec name
    take("I")  # revision
    variables = {}
    for _ in range(take("I")):
        name = string()
        rank = take("B")
        shape = [take("I") for _ in range(rank)]
        dtype, size = take("B"), take("I")
        raw = data[pos:pos + size]
        pos += size
        if DTYPES[dtype] is None:  # bfloat16: the high half of a float32
            value = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            value = np.frombuffer(raw, DTYPES[dtype])
        variables[name] = value.reshape(shape)
    aliases = {string(): string() for _ in range(take("I"))}
    return variables, aliases

"""A differential fuzz of offload.load against the safetensors package.

Valid files are mutated (header fields, offsets, shapes, dtypes, lengths,
byte flips, truncation); both loaders read each one. They must agree: both
refuse it, or both load the same tensors bit for bit. offload must refuse
with CheckpointError only, never another exception. One difference is by
design: an empty tensor whose shape torch.empty cannot make (its strides
overflow int64) is refused by offload, while safetensors' load_file builds
it by reshaping; and a header that names a tensor twice is refused as
ambiguous, where safetensors keeps one of the two. Such files are counted
apart.

    python tests/helpers/safetensors_fuzz.py DIR [--files N] [--seed S]

prints a JSON summary (tests/test_checkpoint.py runs a seeded quick one).
"""
import argparse
import json
import os
import random
import struct
import sys

import torch
from safetensors.torch import load_file, save

import offload
from offload import CheckpointError

_SIZES = [0, 1, 2, 3, 7, 8, 64, 4096, 2 ** 31, 2 ** 32, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 10 ** 30]
_CODES = ["BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64",
          "F8_E4M3", "F8_E5M2", "C64", "XX", "", 7, None]


def _seed_file(rng) -> bytes:
    tensors = {}
    for i in range(rng.randint(1, 4)):
        dtype = rng.choice([torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool])
        shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
        t = torch.randint(0, 2, shape, dtype=torch.uint8).to(dtype) if dtype == torch.bool else \
            torch.randint(-100, 100, shape).to(dtype)
        tensors[f"t{i}"] = t
    return save(tensors, metadata=rng.choice([None, {"format": "pt"}]))


def _split(blob: bytes):
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def _join(header, data: bytes, pad: bool) -> bytes:
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def mutate(rng, blob: bytes) -> bytes:
    """One random mutation of a valid file."""
    kind = rng.randrange(9)
    header, data = _split(blob)
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    if kind == 0:    # one size of the shape
        if entry["shape"]:
            entry["shape"][rng.randrange(len(entry["shape"]))] = rng.choice(_SIZES)
        else:
            entry["shape"] = [rng.choice(_SIZES)]
    elif kind == 1:  # a shape with a zero and a huge size: empty, but beyond int64
        entry["shape"] = [rng.choice(_SIZES) for _ in range(rng.randint(1, 4))] + [0]
        rng.shuffle(entry["shape"])
    elif kind == 2:  # the offsets
        i = rng.randrange(2)
        entry["data_offsets"][i] = max(0, entry["data_offsets"][i] + rng.choice([-8, -1, 1, 8, 2 ** 40]))
    elif kind == 3:  # the dtype
        entry["dtype"] = rng.choice(_CODES)
    elif kind == 4:  # a field removed, or of the wrong type
        field = rng.choice(["dtype", "shape", "data_offsets"])
        if rng.random() < 0.5:
            del entry[field]
        else:
            entry[field] = rng.choice(["x", 1.5, [], {}, [1, "a"], -1])
    elif kind == 5:  # the header length prefix
        length = struct.unpack("<Q", blob[:8])[0] + rng.choice([-1, 1, -8, 8, 2 ** 40])
        return struct.pack("<Q", length & (2 ** 64 - 1)) + blob[8:]
    elif kind == 6:  # a byte flipped anywhere
        i = rng.randrange(len(blob))
        return blob[:i] + bytes([blob[i] ^ (1 << rng.randrange(8))]) + blob[i + 1:]
    elif kind == 7:  # truncated, or bytes appended
        if rng.random() < 0.5:
            return blob[:rng.randrange(len(blob))]
        return blob + bytes(rng.randint(1, 16))
    else:            # metadata of the wrong kind
        header["__metadata__"] = rng.choice([{"a": 1}, ["x"], "s", {"k": "v"}])
    return _join(header, data, pad=rng.random() < 0.5)


def _makeable(shape) -> bool:
    """Whether torch.empty accepts the shape. safetensors' load_file reshapes
    an empty tensor, which torch allows with strides that overflow; offload
    refuses such shapes by design (what torch.empty cannot make)."""
    try:
        torch.empty(shape, device="meta")
    except RuntimeError:
        return False
    return True


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def run(directory: str, files: int, seed: int) -> dict:
    rng = random.Random(seed)
    path = os.path.join(directory, "fuzz.safetensors")
    counts = {"both_refuse": 0, "both_load": 0, "only_safetensors_loads_an_unmakeable_empty_shape": 0,
              "only_safetensors_loads_a_header_naming_a_tensor_twice": 0}
    disagreements = []
    for i in range(files):
        blob = mutate(rng, _seed_file(rng))
        with open(path, "wb") as f:
            f.write(blob)
        try:
            theirs = load_file(path)
        except Exception as error:  # the package's verdict: any refusal
            theirs = error
        try:
            ours = offload.load(path, progress=False)
        except CheckpointError as error:
            ours = error
        except Exception as error:  # anything but CheckpointError is a defect
            disagreements.append(f"file {i}: offload raised {type(error).__name__}: {error}")
            continue
        if isinstance(theirs, Exception) and isinstance(ours, Exception):
            counts["both_refuse"] += 1
        elif isinstance(ours, CheckpointError) and "beyond what torch can hold" in str(ours) and \
                any(not _makeable(t.shape) for t in theirs.values()):
            counts["only_safetensors_loads_an_unmakeable_empty_shape"] += 1
        elif isinstance(ours, CheckpointError) and "appears twice" in str(ours):
            counts["only_safetensors_loads_a_header_naming_a_tensor_twice"] += 1
        elif not isinstance(theirs, Exception) and not isinstance(ours, Exception) and _same(theirs, ours):
            counts["both_load"] += 1
        else:
            disagreements.append(f"file {i}: safetensors {type(theirs).__name__}, offload {type(ours).__name__}"
                                 f" ({ours if isinstance(ours, Exception) else ''})")
    return {"files": files, "seed": seed, **counts, "disagreements": disagreements[:20],
            "disagreement_count": len(disagreements)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    summary = run(args.directory, args.files, args.seed)
    print(json.dumps(summary))
    sys.exit(1 if summary["disagreement_count"] else 0)

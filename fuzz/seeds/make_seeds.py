#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target into fuzz/corpus/<target>/ (scripts/fuzz.sh runs
this when a corpus directory is empty; the checked-in corpus already holds its output, plus
what fuzzing added, merged with -merge=1).

Seeds come from real inputs: the header and config.json of .mx/models/smollm2-135m and
minilm-l6 when present (scripts/setup.sh makes them), a small safetensors file, an index over
two shards, and journal lines in the format mx-control writes (checksummed)."""

import base64
import json
import os
import struct
import sys
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)] -> a whole file."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def real_header(path, keep=4):
    """The real header of `path` with its first `keep` tensors, shrunk to 1-row shapes over a
    matching small data section (so the seed parses)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None)
    size = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}
    tensors = []
    for name in sorted(header)[:keep]:
        t = header[name]
        shape = [1] + t["shape"][1:2]
        numel = 1
        for d in shape:
            numel *= d
        tensors.append((name, t["dtype"], shape, bytes(numel * size.get(t["dtype"], 4))))
    return safetensors(tensors, meta), sorted(header)


def crc_line(entry):
    body = json.dumps(entry, separators=(",", ":"))
    assert body.endswith("}")
    body = body[:-1]
    return body + ',"crc32":"%08x"}\n' % (zlib.crc32(body.encode()) & 0xFFFFFFFF)


def main():
    models = os.path.join(REPO, ".mx", "models")
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    put("safetensors_header", "small", safetensors(
        [("a", "F32", [2, 2], bytes(16)), ("b", "BF16", [3], bytes(6)), ("s", "I64", [], bytes(8))],
        {"format": "pt"}))
    for model in ("smollm2-135m", "minilm-l6"):
        st = os.path.join(models, model, "model.safetensors")
        if os.path.exists(st):
            seed, all_names = real_header(st)
            put("safetensors_header", model, seed)
            if model == "smollm2-135m":
                names = all_names
        cfg = os.path.join(models, model, "config.json")
        if os.path.exists(cfg):
            put("config_json", model, open(cfg, "rb").read())
    put("config_json", "tiny-llama", json.dumps({
        "model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 16, "vocab_size": 32, "num_hidden_layers": 2, "tie_word_embeddings": True}))
    half = len(names) // 2
    wm = {n: "model-0000%d-of-00002.safetensors" % (1 if i < half else 2) for i, n in enumerate(names)}
    put("safetensors_index", "two-shards", json.dumps({"metadata": {"total_size": 1234}, "weight_map": wm}, indent=2))

    digest = "ab" * 32
    box = {"global_offset": [0, 0], "local_shape": [2, 4]}
    manifest = {
        "slot": 0, "layout": {"scheme": "Fsdp", "world_size": 1}, "agent_name": "trainer-0",
        "agent_metadata": base64.b64encode(b"nixl-agent-metadata").decode(),
        "shards": [{"tensor": "w", "dtype": "BF16", "global_shape": [2, 4], "shard": box,
                    "addr": 4096, "len": 16, "device": "Dram", "digest": digest}],
        "pieces": [{"layout": {"scheme": "VllmTp", "world_size": 1}, "dest_rank": 0, "tensor": "w",
                    "region": box, "digest": digest}],
        "pack_seconds": 0.25,
    }
    put("manifest", "fsdp1", json.dumps(manifest))
    records = [
        {"op": "register", "worker_id": "w0", "instance": "i0", "ranks": [0],
         "layout": {"scheme": "VllmTp", "world_size": 1}},
        {"op": "declare", "label": "step-1", "trainer_layout": {"scheme": "Fsdp", "world_size": 1},
         "tensors": [{"name": "w", "dtype": "BF16", "shape": [2, 4]}]},
        {"op": "publish", "label": "step-1", "manifest": manifest},
        {"op": "stage", "label": "step-1", "worker_ids": ["w0"]},
    ]
    lines = "".join(crc_line({"seq": i + 1, "unix_ms": 1718000000000 + i, "record": r})
                    for i, r in enumerate(records))
    put("journal_replay", "fleet", lines)
    legacy = json.dumps({"seq": 1, "unix_ms": 5, "record": records[0]}, separators=(",", ":")) + "\n"
    put("journal_replay", "legacy-then-torn", legacy + '{"seq":2,"unix_ms":')
    # The wire target: the first byte picks the message; an empty message of each kind.
    for k in range(12):
        put("wire", "empty-%02d" % k, bytes([k]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

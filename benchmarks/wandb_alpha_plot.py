"""α over time from a W&B run file (offline runs write one: .../offline-run-*/run-*.wandb).

    python benchmarks/wandb_alpha_plot.py RUN.wandb OUT.png

wandb 0.31 ships no reader for its run files, so this reads the format directly: a 7-byte file
header, then LevelDB-log framing (32 KiB blocks; 7-byte record headers: crc32, length, type
FULL/FIRST/MIDDLE/LAST) around protobuf `Record`s; history rows are `Record.history`.
"""

from __future__ import annotations

import json
import struct
import sys

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, buf = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            buf = chunk
        elif kind == MIDDLE:
            buf += chunk
        elif kind == LAST:
            yield buf + chunk
        else:
            break  # zero padding at the end of a file still being written


def history(path: str) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item})
    return rows


def main(path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in history(path) if "time" in r]
    t0 = rows[0]["time"]
    fig, ax = plt.subplots(figsize=(8, 4))
    experts = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("alpha/")})
    for e in experts:
        pts = [(r["time"] - t0, r[f"alpha/{e}"]) for r in rows if f"alpha/{e}" in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"expert {e}")
    # a published version or a rollback; the version each expert starts at is logged too, and is neither
    vs = [(r["time"] - t0, k) for r in rows for k in r if k.startswith("version/") and r[k] is not None
          and (r.get(f"published/{k[8:]}") == 1 or r.get(f"rollback/{k[8:]}"))]
    for t, _ in vs:
        ax.axvline(t, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("seconds since the first logged row")
    ax.set_ylabel("acceptance α (per logging window)")
    ax.set_ylim(0, 1)
    ax.set_title("α over time, from the W&B offline run (dotted: published draft versions)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(json.dumps({"rows": len(rows), "experts": experts, "versions": len(vs)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

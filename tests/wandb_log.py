"""Reads the records of an offline wandb run's .wandb file, which wandb's service may still be writing."""

import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type, data) chunks
HEADER = 7  # crc (4 bytes), length (2), type (1)
FULL, LAST = 1, 4


def wandb_records(path) -> list:
    """Every whole record (wandb_internal_pb2.Record) of a .wandb file, in the order wandb wrote them.

    The file may be read while it grows, or after its writer was killed, so it may end in a torn chunk:
    the records before it are returned and the torn one is left out; a reader that needs a last record
    (the exit record) reads again."""
    data = Path(path).read_bytes()
    assert struct.unpack("<4sHB", data[:HEADER])[0] == b":W&B"
    records, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # zeros: the rest of this block is unwritten or padding
            pos += room
            continue
        if pos + HEADER + length > len(data):  # a torn chunk: its data is not all on disk yet
            break
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)  # a whole record that does not parse is corruption: it raises
            records.append(record)
            pending = b""
    return records


def finished_run_records(path, timeout: float = 30.0) -> list:
    """The records of a run that finished: read until its exit record is on disk. wandb's service process
    may still be writing the file when the run's finish() (or its process) has returned; up to `timeout`
    seconds, since the suite's parallel workers can slow the service down."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)

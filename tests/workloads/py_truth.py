"""Ground truth for the Python frames read in BPF: threads doing random
2-40 ms steps, each step leaving its own native or kernel signature.

usage: py_truth.py SECONDS [THREADS]

step_hash -> libcrypto (or the _sha2/_sha256 module), step_zlib -> libz,
step_write -> the kernel's write path (vfs_write), step_json -> _json,
step_pure -> the interpreter alone.  A sample whose native or kernel frames
show one signature belongs under that step's function.  Runs with any
CPython from 3.8 (no f-strings beyond 3.6 syntax, no walrus).
"""

import hashlib
import json
import os
import random
import sys
import tempfile
import threading
import time

import zlib

DATA = os.urandom(1 << 16)
JSON_OBJ = {"k%d" % i: [i, str(i) * 3, {"x": i * 0.5}] for i in range(300)}


def step_hash(deadline):
    while time.perf_counter() < deadline:
        hashlib.sha256(DATA).digest()


def step_zlib(deadline):
    while time.perf_counter() < deadline:
        zlib.compress(DATA, 6)


def step_write(deadline, fd):
    chunk = DATA
    while time.perf_counter() < deadline:
        os.pwrite(fd, chunk, 0)


def step_json(deadline):
    while time.perf_counter() < deadline:
        json.dumps(JSON_OBJ)


def step_pure(deadline):
    while time.perf_counter() < deadline:
        total = 0
        for i in range(2000):
            total += i * i


def worker(seconds, seed, fd):
    rnd = random.Random(seed)
    end = time.perf_counter() + seconds
    steps = (step_hash, step_zlib, step_write, step_json, step_pure)
    while time.perf_counter() < end:
        step = rnd.choice(steps)
        deadline = min(end, time.perf_counter() + rnd.uniform(0.002, 0.040))
        if step is step_write:
            step(deadline, fd)
        else:
            step(deadline)


def main():
    seconds = float(sys.argv[1])
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    fd, path = tempfile.mkstemp(prefix="flamed-truth-")
    os.unlink(path)
    ts = [threading.Thread(target=worker, args=(seconds, i, fd), name="truth-%d" % i) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)


if __name__ == "__main__":
    main()

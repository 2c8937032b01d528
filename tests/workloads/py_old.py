"""A workload any CPython from 2.7 on runs (no f-strings, no print calls):
phases of 100 ms of a pure-Python loop and of a kernel-heavy loop on the
main thread (long phases: py-spy's stacks are joined to the samples by time).

usage: py_old.py SECONDS

old_compute -> the interpreter alone; old_kernel -> the kernel's random
number generator (os.urandom: getrandom(2), or reads of /dev/urandom on 2.7),
so a mixed stack shows old_kernel above the kernel's frames.  For the interpreters py-spy reads and the BPF walker does not
(2.7, 3.6, 3.7).
"""

import os
import sys
import time


def old_compute(deadline):
    s = 0
    while time.time() < deadline:
        for i in range(1000):
            s += i * i
    return s


def old_kernel(deadline):
    while time.time() < deadline:
        os.urandom(1 << 16)


def main(seconds):
    end = time.time() + seconds
    while time.time() < end:
        old_compute(time.time() + 0.1)
        old_kernel(time.time() + 0.1)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)

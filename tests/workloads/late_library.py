"""Loads a C library only after a delay, runs in it, and exits.

usage: late_library.py DELAY_S RUN_S

ctypes and libbz2 are mapped DELAY_S after start (well after the sampler's
first reads of the process's maps), then libbz2's compressor runs for RUN_S.
A sampler that drains only after the exit must still name those frames
(:func:`names_libbz2` tells a stack that does).  Runs with any CPython 3;
fails if libbz2 was mapped before (an interpreter that links it at start
would not test a late load).
"""

import ctypes
import sys
import time

LIB = "libbz2.so.1.0"


def names_libbz2(stack):
    """Does this stack (frame names) have a frame named in libbz2?"""
    return any("libbz2" in f or f.startswith("BZ2_") for f in stack)


def main():
    time.sleep(float(sys.argv[1]))
    with open("/proc/self/maps") as f:
        if "libbz2" in f.read():
            sys.exit("libbz2 was mapped before it was loaded")
    bz2 = ctypes.CDLL(LIB)
    src = bytes(range(256)) * 64
    dst = ctypes.create_string_buffer(len(src) * 2)
    size = ctypes.c_uint()
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        size.value = len(dst)
        rc = bz2.BZ2_bzBuffToBuffCompress(dst, ctypes.byref(size), src, ctypes.c_uint(len(src)), 9, 0, 30)
        if rc != 0:
            sys.exit("BZ2_bzBuffToBuffCompress: %d" % rc)


if __name__ == "__main__":
    main()

"""Python workload for the captured fixtures: a few nested pure-Python functions."""
import sys
import time


def leaf(n: int) -> int:
    return sum(i * i for i in range(n))


def middle(n: int) -> int:
    return leaf(n) + leaf(n // 2)


def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def main(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        middle(2000)
        fib(15)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)

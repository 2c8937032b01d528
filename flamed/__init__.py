"""flamed: a system-wide continuous profiler for Linux, and an offline flame graph toolkit."""

__version__ = "0.1.0"

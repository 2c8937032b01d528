"""Errors of the CPython frame reader."""

from __future__ import annotations

from flamed.errors import FlamedError


class CPythonError(FlamedError):
    """A CPython process or interpreter build flamed cannot read frames of."""


class UnsupportedVersion(CPythonError):
    """No layout table for this CPython version."""


class LayoutError(CPythonError):
    """A layout that does not fit the BPF program's reads, or does not validate."""

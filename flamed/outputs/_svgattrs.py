"""flamegraph.pl's ``--nameattr`` file: extra SVG attributes for the boxes of a function.

Each line is a function name, a tab, then tab-separated ``key=value`` pairs.
The keys flamegraph.pl knows are the ones used here: ``title`` (replaces the
tooltip text), ``id`` and ``class`` (attributes of the box's group),
``g_extra`` (attribute text added as is), ``href`` (the box becomes a link:
an ``<a xlink:href>`` instead of a ``<g>``), ``target`` (the link's target,
``_top`` by default) and ``a_extra`` (attribute text added to the link).
Other keys are ignored, as flamegraph.pl ignores them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from flamed.errors import InputError
from flamed.model import decode_frame

XLINK = "http://www.w3.org/1999/xlink"

# References XML knows without a DTD: written by the user, they are kept; any
# other "&" is escaped, so that a value meant for flamegraph.pl (which writes
# values as they are) and a plain one both come out well-formed.
_BARE_AMP = re.compile(r"&(?!(?:amp|lt|gt|quot|apos|#[0-9]+|#x[0-9a-fA-F]+);)")
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


@dataclass(frozen=True)
class NameAttr:
    """How the box of one function name is written."""

    #: ``a`` (a link) or ``g``.
    tag: str
    #: The element's attributes, each with a leading space.
    attrs: str
    #: Tooltip text replacing ``name (N samples, P%)``, XML-safe; None: the usual one.
    title: str | None


def markup_value(text: str) -> str:
    """A user's value as XML text or attribute value: references kept, the rest escaped."""
    text = _CONTROL.sub(" ", text)
    return _BARE_AMP.sub("&amp;", text).replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _entry(fields: dict[str, str], source: str, lineno: int) -> NameAttr:
    href = fields.get("href")
    attrs: list[str] = []
    if href:
        attrs.append(f'xlink:href="{markup_value(href)}"')
        attrs.append(f'target="{markup_value(fields.get("target") or "_top")}"')
        if fields.get("a_extra"):
            attrs.append(_CONTROL.sub(" ", fields["a_extra"]))
    for key in ("id", "class"):
        if key in fields:
            attrs.append(f'{key}="{markup_value(fields[key])}"')
    if fields.get("g_extra"):
        attrs.append(_CONTROL.sub(" ", fields["g_extra"]))
    text = "".join(" " + a for a in attrs)
    try:
        # The ``*_extra`` values are attribute text written as is: it must parse, next to
        # the attributes flamed adds itself.
        ET.fromstring(f'<g xmlns:xlink="{XLINK}"{text} data-a="k" data-n="n" data-i="0"/>')
    except ET.ParseError as e:
        raise InputError(f"these attributes do not make well-formed XML ({e}): {text.strip()}", source=source,
                         line=lineno) from None
    title = fields.get("title")
    return NameAttr("a" if href else "g", text, markup_value(title) if title else None)


def read_nameattr(path: str) -> dict[str, NameAttr]:
    """The ``--nameattr`` file at ``path``, by function name (as in the folded input,
    with any ``_[k]``-style annotation)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"cannot read the --nameattr file: {e.strerror or e}", source=path) from None
    out: dict[str, NameAttr] = {}
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        line = raw.rstrip(b"\r")
        if not line.strip():
            continue
        name, tab, rest = line.partition(b"\t")
        if not tab:
            raise InputError("expected 'NAME<TAB>key=value<TAB>...'", source=path, line=lineno)
        fields: dict[str, str] = {}
        for pair in rest.split(b"\t"):
            if not pair:
                continue
            key, eq, value = pair.partition(b"=")
            if not eq:
                raise InputError(f"expected key=value, got {decode_frame(pair)!r}", source=path, line=lineno)
            fields[decode_frame(key)] = decode_frame(value)
        out[decode_frame(name)] = _entry(fields, path, lineno)
    return out

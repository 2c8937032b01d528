"""Write the package's /usr/share/doc/flamed/copyright (Debian's machine-readable format, DEP-5).

    python packaging/debian-copyright.py OUT SITE DIST[=PATTERN]...

flamed's own stanza is fixed; one stanza per bundled distribution is derived
from its installed metadata (license expression, license files, the copyright
lines in them, the files it installed), so a dependency bump never leaves a
stale notice. ``SITE`` is where the package puts the bundled Python
distributions (``usr/lib/flamed/site``); a ``DIST`` alone covers the top-level
names of its installed files under SITE; ``DIST=PATTERN`` names the files
instead (e.g. ``py-spy=usr/lib/flamed/bin/py-spy``).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

HEADER = """\
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: flamed
Source: https://localhost/flamed

Files: *
Copyright: flamed contributors
License: Apache-2.0
"""

APACHE = """\
License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the "License");
 you may not use this file except in compliance with the License.
 You may obtain a copy of the License at
 .
     http://www.apache.org/licenses/LICENSE-2.0
 .
 Unless required by applicable law or agreed to in writing, software
 distributed under the License is distributed on an "AS IS" BASIS,
 WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
 See the License for the specific language governing permissions and
 limitations under the License.
 .
 On Debian systems, the complete text of the Apache License, Version 2.0
 can be found in "/usr/share/common-licenses/Apache-2.0".
"""

#: SPDX identifiers and the free-text names wheels use -> the short names of the DEP-5 spec.
SHORT_NAMES = {
    "GPL-2.0-or-later": "GPL-2+", "GPL-2.0-only": "GPL-2", "MIT": "Expat", "MIT License": "Expat",
    "3-Clause BSD License": "BSD-3-clause", "BSD-3-Clause": "BSD-3-clause", "BSD-2-Clause": "BSD-2-clause",
    "Apache-2.0": "Apache-2.0", "Apache Software License": "Apache-2.0",
}
#: Trove classifiers, for wheels that say nothing else.  "BSD License" alone names no
#: variant: the license text decides (two or three clauses).
CLASSIFIERS = {"MIT License": "Expat", "Apache Software License": "Apache-2.0"}


def short_name(expr: str) -> str:
    """An SPDX expression (``A AND B``, ``A OR B``) in DEP-5 words (``A and B``, ``A or B``)."""
    parts = re.split(r"\s+(AND|OR)\s+", expr.strip())
    return " ".join(p.lower() if p in ("AND", "OR") else SHORT_NAMES.get(p, p.replace(" ", "-")) for p in parts)


def license_of(dist: metadata.Distribution, texts: str) -> str:
    meta = dist.metadata
    expr = meta.get("License-Expression") or ""
    if not expr:
        lic = (meta.get("License") or "").strip()
        if lic and "\n" not in lic and len(lic) < 60:
            expr = lic
    if not expr:
        for c in meta.get_all("Classifier") or []:
            if c.startswith("License :: OSI Approved :: "):
                name = c.rsplit(" :: ", 1)[1]
                if name in CLASSIFIERS:
                    return CLASSIFIERS[name]
                if name == "BSD License":
                    # The third clause is the one forbidding endorsement by the authors' names.
                    return "BSD-3-clause" if "endorse or promote" in " ".join(texts.split()) else "BSD-2-clause"
    if not expr:
        raise SystemExit(f"debian-copyright: {dist.metadata['Name']} states no license; name it in SHORT_NAMES")
    return short_name(expr)


#: Licenses Debian ships in /usr/share/common-licenses: referenced there, never copied
#: (lintian: copyright-file-contains-full-*-license).  Text that identifies one -> its short name.
COMMON = {
    "Apache-2.0": re.compile(r"Apache License\s+Version 2\.0, January 2004"),
    "GPL-2+": re.compile(r"GNU GENERAL PUBLIC LICENSE\s+Version 2, June 1991"),
}
COMMON_FILES = {"Apache-2.0": "Apache-2.0", "GPL-2+": "GPL-2"}


def license_texts(dist: metadata.Distribution) -> tuple[list[str], list[str], list[str]]:
    """(texts to quote, common licenses referenced instead, every text) of a distribution's license files."""
    out: list[str] = []
    common: list[str] = []
    every: list[str] = []
    for f in dist.files or []:
        parts = f.parts
        if len(parts) >= 2 and parts[0].endswith(".dist-info") and re.match(r"(LICEN[CS]E|COPYING|NOTICE)", parts[-1]):
            text = f.read_text() or ""
            every.append(text)
            known = [name for name, rx in COMMON.items() if rx.search(text[:2000])]
            if known:
                common += [k for k in known if k not in common]
            else:
                out.append(text)
    if not out and not common:
        raise SystemExit(f"debian-copyright: {dist.metadata['Name']} ships no license file")
    return out, common, every


def copyright_lines(texts: list[str], name: str) -> list[str]:
    seen: list[str] = []
    for t in texts:
        for line in t.splitlines():
            s = line.strip().lstrip("/#* ").strip()  # license texts copied from source comments
            # Template lines of the license texts themselves ("Copyright [yyyy] [name ...]").
            # The FSF's line is the GPL text's own copyright, not the software's.
            if (re.match(r"(?i)copyright\s+(\(c\)\s*)?(\d|©)", s) and s not in seen
                    and "Free Software Foundation" not in s):
                seen.append(re.sub(r"(?i)^copyright\s+", "", s))
    return seen or [f"the {name} authors"]


def indent(text: str) -> str:
    lines = [ln.rstrip() for ln in text.strip("\n").splitlines()]
    return "\n".join(" " + ln if ln else " ." for ln in lines)


def site_patterns(dist: metadata.Distribution, site: str) -> str:
    """The top-level names a distribution installed into site-packages, as DEP-5 patterns."""
    tops: list[str] = []
    for f in dist.files or []:
        if f.parts[0] in ("..", "__pycache__") or f.suffix == ".pyc":
            continue  # scripts outside site-packages (../../bin) are not bundled as files of SITE
        top = f"{site}/{f.parts[0]}" + ("/*" if len(f.parts) > 1 else "")
        if top not in tops:
            tops.append(top)
    return " ".join(sorted(tops))


def stanza(dist_name: str, files: str, site: str, common_used: list[str]) -> str:
    dist = metadata.distribution(dist_name)
    files = files or site_patterns(dist, site)
    texts, common, every = license_texts(dist)
    common_used += [c for c in common if c not in common_used]
    holders = copyright_lines(every, dist_name)
    name = license_of(dist, "\n".join(texts))
    comment = f"{dist.metadata['Name']} {dist.version}, bundled"
    if common:
        comment += f"; {', '.join(common)}: see the paragraph below"
    if texts:
        comment += "; the upstream license files follow"
    body = "\n .\n".join(indent(t) for t in texts)
    return (f"Files: {files}\nCopyright: {holders[0]}\n" + "".join(f" {h}\n" for h in holders[1:])
            + f"License: {name}\n" + (body + "\n" if body else "") + f"Comment: {comment}.\n")


def common_paragraph(name: str) -> str:
    return (f"License: {name}\n On Debian systems, the complete text of this license can be found in\n"
            f" \"/usr/share/common-licenses/{COMMON_FILES[name]}\".\n")


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, site, specs = argv[0], argv[1].strip("/"), argv[2:]
    parts = [HEADER]
    common = ["Apache-2.0"]  # flamed's own
    for spec in specs:
        dist_name, _, files = spec.partition("=")
        parts.append(stanza(dist_name, files, site, common))
    parts.append(APACHE)
    parts += [common_paragraph(c) for c in common if c != "Apache-2.0"]
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

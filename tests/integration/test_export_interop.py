"""Real consumers read our exports: `go tool pprof` and speedscope's own importer."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdp import Browser, CDPError, chromium_path
from support import ARTIFACTS, DATA, ROOT, need
from flamed.folded import read_folded
from flamed.model import Profile, Sample
from flamed.outputs.pprof import top_functions, write_pprof
from flamed.outputs.speedscope import samples_document, to_document

pytestmark = [pytest.mark.slow, pytest.mark.concurrent]

SPEEDSCOPE = ROOT / "tests" / ".node" / "node_modules" / "speedscope" / "dist" / "release" / "index.html"


def _profile() -> Profile:
    with gzip.open(DATA / "bcc" / "profile-folded.txt.gz", "rb") as f:
        p = read_folded(f)
    p.add(("app-7/8", "main", "handle (app/web.py:42)", "json_dumps (app/util.py:7)", "memcpy"), 9)
    p.add(("app-7/8", "main", "handle (app/web.py:43)", "sys_write_[k]"), 4)
    p.sample_rate = 99.0
    p.start_ns = 1_764_676_800_000_000_000
    p.end_ns = p.start_ns + 30_000_000_000
    return p


def _go_pprof(args: list[str], tmp_path: Path) -> str:
    go = shutil.which("go")
    need(go is not None, "go (Debian golang-go) for `go tool pprof`")
    env = dict(os.environ, HOME=str(tmp_path), GOCACHE=str(tmp_path / "gocache"), GOTOOLCHAIN="local",
               GOFLAGS="-mod=mod", PPROF_TMPDIR=str(tmp_path))
    r = subprocess.run([go or "go", "tool", "pprof", *args], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r.stdout


_ROW = re.compile(r"^\s*(\d+)\s+[\d.]+%\s+[\d.]+%\s+(\d+)\s+[\d.]+%\s+(.*)$")


def test_go_tool_pprof_top_matches_ours(tmp_path: Path) -> None:
    p = _profile()
    path = tmp_path / "cpu.pb.gz"
    with path.open("wb") as f:
        write_pprof(p, f)
    out = _go_pprof(["-top", "-sample_index=samples", "-nodecount=100000", "-nodefraction=0", "-edgefraction=0",
                     str(path)], tmp_path)
    total = re.search(r"Total samples = (\d+)", out) or re.search(r"of (\d+) total", out)
    assert total is not None, out
    assert int(total.group(1)) == p.total()
    rows = {}
    for line in out.splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(3).strip()] = (int(m.group(1)), int(m.group(2)))
    ours = top_functions(p)
    assert rows == {name: (flat, cum) for name, (flat, cum) in ours.items()}
    # The CPU view: every sample is one period of 1e9/99 ns.
    cpu = _go_pprof(["-top", "-sample_index=cpu", "-unit=ns", "-nodecount=3", str(path)], tmp_path)
    m = re.search(r"Total samples = ([\d.]+)ns", cpu) or re.search(r"of ([\d.]+)ns total", cpu)
    assert m is not None, cpu
    assert float(m.group(1)) == p.total() * round(1e9 / 99)
    # Python lines stay apart in -lines granularity.
    lines = _go_pprof(["-top", "-lines", "-sample_index=samples", "-nodecount=100000", "-nodefraction=0",
                       str(path)], tmp_path)
    assert re.search(r"handle app/web.py:42", lines) and re.search(r"handle app/web.py:43", lines)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    need(chromium_path() is not None, "chromium (Debian package chromium)")
    need(SPEEDSCOPE.exists(), "speedscope from npm (packaging/setup.sh --test installs it into tests/.node)")
    b = Browser(tmp_path / "chromium-profile")
    try:
        yield b
    finally:
        b.close()


def _load_in_speedscope(b: Browser, doc: dict[str, Any], name: str, tmp_path: Path) -> str:
    """Open speedscope's release build the way its CLI does (a local script hands it the
    file) and wait until its importer has produced a view; returns the page text."""
    data = json.dumps(doc).encode()
    loader = tmp_path / (name + ".js")
    loader.write_text(
        f"speedscope.loadFileFromBase64({json.dumps(name)}, {json.dumps(base64.b64encode(data).decode())})"
    )
    b.events.clear()
    # A query string per load makes each a new document (a hash change alone would not reload).
    b.navigate(SPEEDSCOPE.as_uri() + "?load=" + name + "#localProfilePath=" + str(loader))
    want = f"{doc['name']} - speedscope"
    # The view's title, or the importer's refusal (an error page, or an
    # exception or error in the console): no need to wait out the timeout.
    deadline = time.monotonic() + 20
    while True:
        if b.eval(f"document.title === {json.dumps(want)}"):
            break
        if b.eval("/Something went wrong|Unrecognized format/.test(document.body.innerText)"):
            break
        if any(e.get("method") == "Runtime.exceptionThrown" or (e.get("method") == "Runtime.consoleAPICalled"
               and e["params"].get("type") == "error") for e in b.events):
            raise AssertionError(f"speedscope's importer failed on {name}")
        if time.monotonic() > deadline:
            raise CDPError(f"timed out waiting for the title {want!r}")
        time.sleep(0.1)
    body = b.eval("document.body.innerText")
    assert "Something went wrong" not in body and "Unrecognized format" not in body, body[:500]
    logs = [a.get("value") for e in b.events if e.get("method") == "Runtime.consoleAPICalled"
            for a in e["params"].get("args", [])]
    assert "Importing as speedscope json file" in logs, logs
    return str(body)


def test_speedscope_imports_our_profiles(browser: Browser, tmp_path: Path) -> None:
    p = _profile()
    doc = to_document(p, "flamed-test")
    text = _load_in_speedscope(browser, doc, "profile.speedscope.json", tmp_path)
    assert len(doc["profiles"]) == 1 and "flamed-test" in text
    # Roots naming tasks: one profile each; speedscope shows the first as "(1/N)".
    tasks = p.map_stacks(lambda s: (f"app-7/{len(s[0])}",) + s[1:])
    doc = to_document(tasks, "tasks")
    n = len(doc["profiles"])
    assert n >= 3
    text = _load_in_speedscope(browser, doc, "tasks.speedscope.json", tmp_path)
    assert f"{doc['profiles'][0]['name']} (1/{n})" in text, text[:300]
    browser.screenshot(ARTIFACTS / "speedscope-profile.png")

    ms = 1_000_000
    samples = [Sample(i * ms, ("app-1/2", "main", "f" if i < 5 else "g (w.py:3)"), 1) for i in range(10)]
    text = _load_in_speedscope(browser, samples_document(samples, name="stream"), "stream.speedscope.json", tmp_path)
    assert "app (pid 1, tid 2)" in text
    browser.screenshot(ARTIFACTS / "speedscope-evented.png")


def test_speedscope_rejects_what_it_should(browser: Browser, tmp_path: Path) -> None:
    # The check above must be able to fail: a broken document is refused by the importer.
    broken = {"$schema": "https://www.speedscope.app/file-format-schema.json", "shared": {"frames": []},
              "profiles": [{"type": "evented", "name": "x", "unit": "none", "startValue": 0, "endValue": 1,
                            "events": [{"type": "C", "frame": 0, "at": 0}]}]}
    broken["name"] = "broken"
    with pytest.raises((AssertionError, CDPError)):
        _load_in_speedscope(browser, broken, "broken.speedscope.json", tmp_path)


def test_go_tool_pprof_top_matches_flamed_top(tmp_path: Path) -> None:
    # A real capture; `flamed top` and `go tool pprof -top` must list the same
    # functions with the same self and total weights, and the same total.
    import csv

    from flamed.cli import main

    src = DATA / "bcc" / "profile-folded.txt.gz"
    pb_path = tmp_path / "p.pb.gz"
    assert main(["export", "-o", str(pb_path), str(src)]) == 0
    top_csv = tmp_path / "top.csv"
    assert main(["top", "--csv", "--limit", "0", "-o", str(top_csv), str(src)]) == 0
    with top_csv.open(newline="") as f:
        ours = {r["function"]: (int(r["self"]), int(r["total"])) for r in csv.DictReader(f)}
    out = _go_pprof(["-top", "-nodecount=100000", "-nodefraction=0", "-edgefraction=0", str(pb_path)], tmp_path)
    rows = {}
    for line in out.splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(3).strip()] = (int(m.group(1)), int(m.group(2)))
    assert rows == ours
    total = re.search(r"Total samples = (\d+)", out) or re.search(r"of (\d+) total", out)
    assert total is not None and int(total.group(1)) == sum(s for s, _ in ours.values())


def test_speedscope_names_threads_of_a_multi_thread_capture(browser: Browser, tmp_path: Path) -> None:
    # A 4-thread perf script (default fields: thread ids, no pids) exported as a timeline:
    # speedscope lists one profile per thread, named with the thread's command and id.
    from flamed.cli import main

    src = DATA / "perf" / "c-default.txt.gz"
    out = tmp_path / "threads.speedscope.json"
    assert main(["export", "-o", str(out), str(src)]) == 0
    doc = json.loads(out.read_text())
    names = [p["name"] for p in doc["profiles"]]
    assert sorted(names) == ["hot (tid 11166)", "job:2 (tid 11170)", "worker 0 (tid 11168)", "worker 1 (tid 11169)"]
    text = _load_in_speedscope(browser, doc, "threads.speedscope.json", tmp_path)
    assert f"{names[0]} (1/4)" in text, text[:300]
    assert "pid 0" not in text
    browser.screenshot(ARTIFACTS / "speedscope-threads.png")


def test_go_tool_pprof_shows_the_names_flamed_printed(tmp_path: Path) -> None:
    # Names pprof's "simplify" demangling would cut when told they are not demangled yet:
    # Rust trait impls, C++ template instantiations (which it would merge), argument lists.
    p = Profile(sample_rate=99.0)
    names = [
        "<[u8: 32] as nasty::Crunch>::crunch+0x4c",
        "void work<int>(int)",
        "void work<long>(long)",
        "std::vector<int, std::allocator<int> >::push_back(int const&)",
        "<alloc::vec::Vec<T> as core::ops::Drop>::drop",
    ]
    for i, leaf in enumerate(names):
        # The first frame that names a module is a library: it must not be taken for the binary.
        p.add(("crunchy", "[libbfd-2.40.so]", "main", leaf), 10 + i)
    p.add(("helper", "main", "idle"), 3)
    path = tmp_path / "names.pb.gz"
    with path.open("wb") as f:
        write_pprof(p, f)
    out = _go_pprof(["-top", "-sample_index=samples", "-nodecount=100000", "-nodefraction=0", "-edgefraction=0",
                     str(path)], tmp_path)
    assert "File: crunchy" in out, out
    rows = {m.group(3).strip(): int(m.group(1)) for m in map(_ROW.match, out.splitlines()) if m}
    for i, leaf in enumerate(names):
        assert rows.get(leaf) == 10 + i, (leaf, out)
    assert rows == {n: flat for n, (flat, _) in top_functions(p).items()}
    traces = _go_pprof(["-traces", "-sample_index=samples", str(path)], tmp_path)
    assert "File: crunchy" in traces
    for leaf in names:
        assert re.search(r"^\s+(?:\d+\s+)?" + re.escape(leaf) + r"$", traces, re.M), (leaf, traces)




def test_speedscope_opens_empty_profiles(browser: Browser, tmp_path: Path) -> None:
    """An empty capture (or one whose stacks all weigh 0) exported to
    speedscope opens as an empty graph: a file without profiles left
    speedscope's page loading forever."""
    for name, doc in [
        ("empty", to_document(Profile({}), "empty")),
        ("zero", to_document(Profile({("app", "idle"): 0}), "zero")),
        ("nostream", samples_document([], name="nostream")),
    ]:
        assert len(doc["profiles"]) == 1, doc
        _load_in_speedscope(browser, doc, name + ".speedscope.json", tmp_path)

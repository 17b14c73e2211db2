"""A tab on a package without its fp32 variant (issue 42): it is welcomed at once and its fp32 units
are built as its loads need them (its calibration's range, then its stage), so the package grows by
those units only, measured in bytes on disk; the tab and the serve log say what is being built, and
a tab that leaves while its units are built costs no traceback.

The session's bundled package is hard-linked into a home of its own without any fp32 unit
(``test_variant_units.bare_copy``). ``--placement memory`` and the declared memory put the last
``TAB_UNITS`` units (a layer and the head) in the tab, as in ``test_browser_worker.py``.
"""

from __future__ import annotations

import pytest

from edgepipe.cluster.shells.calibration import Calibrator
from edgepipe.cluster.rules.variant_rules import unit_sizes
from edgepipe.model.package import Package

from browser import browser_context
from harness import Server
from test_browser_worker import PROMPT, chat, open_worker_tab, reference_tokens
from test_variant_units import bare_copy, disk_bytes

pytestmark = pytest.mark.browser

TAB_UNITS = 2  # the last layer and the head


@pytest.fixture(scope="module")
def bare_home(tmp_path_factory, native_pkg):
    home = tmp_path_factory.mktemp("tab-variant-home")
    return home, bare_copy(native_pkg, home / "models" / native_pkg.root.name)


@pytest.mark.slow  # ~40-100 s of chromium and a variant build; the partial build and its budget run by default (test_variant_units)
def test_a_tab_joins_at_once_and_the_package_grows_by_its_units_only(bare_home):
    home, pkg = bare_home
    n = len(pkg.manifest.units)
    before = disk_bytes(pkg.root)
    log = home / "serve.log"
    with browser_context() as context, \
            Server(home, workers=1, args=("--placement", "memory", "--min-workers", "2"), wait_up=False, log=log) as server:
        native = server.wait_for(lambda s: len(s["workers"]) == 1, 60)["workers"][0]
        url = f"{server.url}/worker?memory={native['memory_bytes'] * TAB_UNITS // (n - TAB_UNITS)}&name=tab"
        # A first tab leaves while the units of its calibration are being built.
        early = context.new_page()
        early.goto(url)
        server.wait_for(lambda s: any(e["kind"] == "variant" and e.get("status") == "building" for e in server.events()), 60)
        early.close()
        page = open_worker_tab(context, url)
        tab = page.locator("#worker-id").inner_text()
        status = server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["plan"]["stages"]) == 2
                                 and s["plan"]["stages"][-1]["worker"] == tab, 150)
        got = chat(server, PROMPT, 8)
        events = server.events()
        page_log = page.locator("#log").inner_text()
        # measured while both workers serve (when serve stops, the tab alone may be given the whole model)
        after = Package(pkg.root)
        added = {sha: size for sha, size in disk_bytes(pkg.root).items() if sha not in before}
    start, end = Calibrator.span(after.manifest)
    stage = (n - TAB_UNITS, n)
    assert [(s["start"], s["end"]) for s in status["plan"]["stages"]][-1] == stage
    # fp32 holds the calibration's units and the tab's stage, nothing else
    built = sorted(set(range(start, end)) | set(range(*stage)))
    assert [u.index for u in after.manifest.units if "fp32" in u.variants] == built
    # the package grew by those units' weight files (and graphs, a few kB each), not by a whole fp32 copy
    weights = {sha for u in built for sha in after.manifest.variant(u, "fp32").files} - set(before)
    assert weights <= set(added) and all(size < 4 << 20 for sha, size in added.items() if sha not in weights)
    whole = sum(unit_sizes(after.manifest, "fp32")) - unit_sizes(after.manifest, "fp32")[0]  # the head's table counted once
    grown = sum(added.values())
    assert sum(added[s] for s in weights) <= grown < sum(after.manifest.variant(u, "fp32").weight_bytes for u in built) + (8 << 20)
    assert grown < 0.5 * whole, (grown, whole)
    # the tab was welcomed before its units were built: its join comes before the build it waited for
    joined = next(i for i, e in enumerate(events) if e["kind"] == "join" and e["worker"] == tab)
    ready = [i for i, e in enumerate(events) if e["kind"] == "variant" and e.get("status") == "ready" and e.get("worker") == tab]
    assert ready and joined < ready[0], [e for e in events if e["kind"] in ("join", "variant")]
    # it said so on the tab and in serve's terminal, in one line per build, and the tab that left cost no traceback
    line = f"fp32 variant of units [{stage[0]}, {stage[1]}) for {tab}: built ({TAB_UNITS} units"
    assert f"coordinator: {line}" in page_log
    text = log.read_text()
    assert f"edgepipe: {line}" in text and "Traceback" not in text and "ChannelClosed" not in text
    # and the tab's fp32 stage serves the reference's tokens
    assert got == reference_tokens(after, status, PROMPT, 8)

"""The dashboard, seen in a real browser: devices, the layer bar, a chat round trip, the speed
charts moving while requests run, and event lines in words (no raw JSON)."""

from __future__ import annotations

import re

import pytest

from browser import browser_context


@pytest.mark.browser
def test_dashboard_renders_devices_bar_and_chat(three_workers, tmp_path):
    server = three_workers
    with browser_context() as context:
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("tr.device >> nth=2", timeout=20000)
        assert page.locator("tr.device").count() == 3
        assert page.locator("#state").inner_text() == "up"
        units = page.locator("#bar span.unit")
        assert units.count() == server.status()["n_units"]
        colours = set(units.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)"))
        assert len(colours) == 3  # one colour per device, every unit placed
        page.fill("#chatinput", "Say hello.")
        page.click("#send")
        page.wait_for_selector("#chatlog[data-done='1']", timeout=60000)
        log = page.locator("#chatlog").inner_text()
        assert log.startswith("you: Say hello.\nmodel: ") and len(log.split("model: ", 1)[1].strip()) > 0
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert float(page.locator("#tps").inner_text()) >= 0
        # The charts gain a point a second, and show the tokens the chat just streamed.
        points = int(page.locator("#chart-tps").get_attribute("data-points"))
        page.wait_for_function(f"Number(document.querySelector('#chart-tps').dataset.points) >= {points + 2}", timeout=10000)
        peaks = page.locator("#chart-tps polyline").get_attribute("points").split()
        assert min(float(p.split(",")[1]) for p in peaks) < 49  # some second had tokens/s above zero
        assert page.locator("#chart-tps-max").inner_text().startswith("max ")
        assert page.locator("#chart-inflight").get_attribute("data-points") is not None
        # The prefix cache: prompts that reused cached blocks out of those it was on for.
        page.wait_for_function(r"/^\d+ \/ [1-9]\d*$/.test(document.querySelector('#prefix-hits').textContent)", timeout=10000)
        assert re.fullmatch(r"\d+", page.locator("#prefix-saved").inner_text())
        # Per-device memory in use (weights + KV of its stage) and utilisation are shown.
        assert all(" of " in t for t in page.locator("tr.device td.mem").all_inner_texts())
        assert page.locator("tr.device td.busy").count() == 3
        # Event lines are sentences: no JSON braces, no quoted keys, no raw floats with long tails.
        lines = page.locator("#events .event").all_inner_texts()
        assert lines, "no events shown"
        for line in lines:
            assert "{" not in line and '":' not in line and "=" not in line, line
            assert not re.search(r"\d\.\d{5,}", line), line

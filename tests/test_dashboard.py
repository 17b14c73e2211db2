"""The dashboard, seen in a real browser: devices, the layer bar, and a chat round trip."""

from __future__ import annotations

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

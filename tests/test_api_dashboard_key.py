"""The dashboard behind --api-key: the page asks for the key once, keeps it in the browser and sends it."""

from __future__ import annotations

import pytest

from browser import browser_context


@pytest.mark.browser
def test_dashboard_asks_for_the_key_and_sends_it(keyed_server):
    server = keyed_server
    with browser_context() as context:
        page = context.new_page()
        asked = []
        page.on("dialog", lambda d: (asked.append(d.message), d.accept("sekrit")))
        page.goto(server.url + "/")
        page.wait_for_selector("tr.device", timeout=20000)
        assert page.locator("#state").inner_text() == "up"
        assert len(asked) == 1 and "API key" in asked[0]
        assert page.evaluate("localStorage.getItem('edgepipe_api_key')") == "sekrit"
        page.fill("#chatinput", "Say hello.")
        page.click("#send")
        page.wait_for_selector("#chatlog[data-done='1']", timeout=60000)
        log = page.locator("#chatlog").inner_text()
        assert "[error" not in log and len(log.split("model: ", 1)[1].strip()) > 0
        page.reload()  # kept in the browser: not asked again
        page.wait_for_selector("tr.device", timeout=20000)
        assert len(asked) == 1

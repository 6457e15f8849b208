"""The HTTP driver without a server: clear errors, no vLLM needed."""

from __future__ import annotations

import pytest

from enginetap.engines.vllm.server import free_port
from enginetap.errors import TrafficError
from enginetap.traffic import HTTPDriver


def test_the_http_driver_says_when_no_server_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrafficError, match="cannot read the served models"):
        HTTPDriver(url, "m", vocab_size=512)
    driver = HTTPDriver(url, "m", max_context=512, vocab_size=512)
    with pytest.raises(TrafficError, match="check that the server is running"):
        driver.reset_prefix_cache()

"""Prometheus endpoints of real processes, scraped and parsed."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon_proc import DaemonProcess, wait_for


def scrape(port: int) -> dict[str, float]:
    """Every sample as ``name{label="v",...}`` -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def metrics_port(d: DaemonProcess) -> int:
    found: list[int] = []

    def logged() -> bool:
        m = re.search(r"metrics http://127\.0\.0\.1:(\d+)/metrics", d.log())
        if m:
            found.append(int(m.group(1)))
        return bool(m)

    wait_for(logged, "the daemon to log its metrics address")
    return found[0]

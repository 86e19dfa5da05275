"""The lint rules of `promtool check metrics`, in Python, for machines without promtool.

CI installs promtool (.ci/run) and lints the live exposition with it; this checker lets the
README's plain `pytest` lint the same way where promtool is missing, and tests/unit/test_metrics.py
checks that it agrees with promtool wherever promtool is installed. It follows the rules of
Prometheus' promlint (client_golang/prometheus/testutil/promlint), each finding worded as
promtool words it.
"""

from __future__ import annotations

import re

_CAMEL = re.compile(r"[a-z][A-Z]")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')
# Non-base units promlint flags -> the base unit it asks for.
_NON_BASE = {
    "minutes": "seconds",
    "hours": "seconds",
    "days": "seconds",
    "weeks": "seconds",
    "milliseconds": "seconds",
    "microseconds": "seconds",
    "nanoseconds": "seconds",
    "kilobytes": "bytes",
    "megabytes": "bytes",
    "gigabytes": "bytes",
    "terabytes": "bytes",
    "bits": "bytes",
    "kilograms": "grams",
    "fahrenheit": "celsius",
    "centimeters": "meters",
    "millimeters": "meters",
}
_ABBREVIATIONS = frozenset(
    {"s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d"}
)
_TYPES = ("counter", "gauge", "histogram", "summary", "untyped")


def _families(text: str) -> dict[str, dict[str, object]]:
    """{family name: {"type", "help", "samples": [(name, label names)]}} in exposition order."""
    families: dict[str, dict[str, object]] = {}

    def family(name: str) -> dict[str, object]:
        return families.setdefault(name, {"type": "untyped", "help": None, "samples": []})

    current = ""
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP ") :].partition(" ")
            family(name)["help"] = help_text
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            family(name)["type"] = kind.strip()
            current = name
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            if match is None:
                continue
            sample, labels = match.group(1), match.group(3) or ""
            owner = current if current and sample.startswith(current) else sample
            samples = family(owner)["samples"]
            assert isinstance(samples, list)
            samples.append((sample, _LABEL.findall(labels)))
    return families


def lint(text: str) -> list[str]:
    """Findings as promtool prints them (`name problem`); empty when the exposition is clean."""
    findings: list[str] = []
    for name, family in _families(text).items():
        kind = str(family["type"])
        samples = family["samples"]
        assert isinstance(samples, list)

        def problem(text: str, metric: str = name) -> None:
            findings.append(f"{metric} {text}")

        if not family["help"]:
            problem("no help text")
        parts = name.split("_")
        for part in parts:
            if part in _NON_BASE:
                problem(f'use base unit "{_NON_BASE[part]}" instead of "{part}"')
            if part in _ABBREVIATIONS:
                problem("metric names should not contain abbreviated units")
        if kind == "counter" and not name.endswith("_total"):
            problem('counter metrics should have "_total" suffix')
        if kind != "counter" and name.endswith("_total"):
            problem('non-counter metrics should not have "_total" suffix')
        if kind not in ("histogram", "summary"):
            for suffix in ("_count", "_sum"):
                if name.endswith(suffix):
                    problem(
                        f'non-histogram and non-summary metrics should not have "{suffix}" suffix'
                    )
        if kind != "histogram":
            if name.endswith("_bucket"):
                problem('non-histogram metrics should not have "_bucket" suffix')
            if any("le" in labels for _, labels in samples):
                problem('non-histogram metrics should not have "le" label')
        if kind != "summary" and any("quantile" in labels for _, labels in samples):
            problem('non-summary metrics should not have "quantile" label')
        for word in _TYPES:
            if word in parts:
                problem(f"metric name should not include type '{word}'")
        if ":" in name:
            problem("metric names should not contain ':'")
        if _CAMEL.search(name):
            problem("metric names should be written in 'snake_case' not 'camelCase'")
        for label in sorted({label for _, labels in samples for label in labels}):
            if _CAMEL.search(label):
                problem("label names should be written in 'snake_case' not 'camelCase'")
    return findings

"""Grafana dashboards and Prometheus rules for stalwart, as code.

`dashboards/definitions.py` defines the four dashboards with the small builder in
`dashboards/grafana.py`; `python -m stalwart.dashboards` writes the committed JSON to
dashboards/grafana/ (tests/unit/test_dashboards.py fails when it drifts, and lints the
rules every panel must follow). The Prometheus rules are in dashboards/rules/.
"""

"""The ingress: the HTTP deployment (`deployment.py`, `Ingress`; its protocols live in `rayserve_apps/edge/`) and its
way to the replicas: one backend per model kind (`backends.py`), ConcatBatching forwarding of text calls
(`forwarding.py`), its own dispatch over group slots (`group_dispatch.py`), the clock each request's deadline and
latency count from (`request_clock.py`) and traffic reports to the controller (`traffic_reporter.py`).
"""

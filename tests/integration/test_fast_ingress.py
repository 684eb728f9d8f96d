"""plexserve's serving mode (`rayserve_apps.fast_ingress`): the environment `make serve` starts Ray with, and the
wrapper that keeps Serve's HAProxy on the loopback interface. (The mode end to end:
tests/integration/test_local_config.py.)"""

import re
import subprocess
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from rayserve_apps.fast_ingress import FAST_INGRESS_ENV, LOOPBACK_WRAPPER, haproxy_binary, local_env, main

REPO = REPO_ROOT

#: Lines as Serve's HAProxy template renders them (ray/serve/_private/haproxy_templates.py).
SERVE_CONFIG = """frontend prometheus
    bind :9101
frontend http_frontend
    bind 127.0.0.1:8000
listen stats
  bind *:8404
"""


def test_make_serve_runs_the_local_config_through_the_fast_ingress():
    (line,) = [line.strip() for line in (REPO / "Makefile").read_text().splitlines()
               if "configs/local.yaml" in line and not line.strip().startswith("@echo")]
    assert line == "$(PY) -m rayserve_apps.fast_ingress configs/local.yaml"


def test_local_env_is_serves_high_throughput_mode_with_loopback_haproxy():
    env = local_env(stats_port=18404, metrics_port=19101)
    assert FAST_INGRESS_ENV.items() <= env.items()
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(LOOPBACK_WRAPPER)
    assert Path(env["PLEXSERVE_HAPROXY_BINARY"]) == Path(haproxy_binary())
    assert (env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"]) == ("18404", "19101")
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in local_env()


def test_the_wrapper_moves_every_listener_to_loopback_and_runs_the_binary_with_the_same_arguments(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG)
    seen = tmp_path / "args"
    binary = tmp_path / "haproxy"
    binary.write_text(f'#!/bin/sh\necho "$@" > {seen}\n')
    binary.chmod(0o755)
    subprocess.run([str(LOOPBACK_WRAPPER), "-db", "-f", str(config), "-sf", "123"], check=True,
                   env={"PLEXSERVE_HAPROXY_BINARY": str(binary), "PATH": "/usr/bin:/bin"})
    binds = re.findall(r"bind (\S+)", config.read_text())
    assert binds == ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:8404"]
    assert seen.read_text().split() == ["-db", "-f", str(config), "-sf", "123"]


def test_launcher_without_a_config_says_how_to_call_it():
    with pytest.raises(SystemExit, match="usage: python -m rayserve_apps.fast_ingress CONFIG.yaml"):
        main([])

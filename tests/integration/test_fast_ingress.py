"""plexserve's serving mode (`rayserve_apps.fast_ingress`): the environment `make serve` starts Ray with, the
wrapper that keeps Serve's HAProxy on the loopback interface and caps what it sends the ingress, and a stop that
leaves nothing behind. (The mode end to end: tests/integration/test_local_config.py.)"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml
from repo_paths import REPO_ROOT
from waiting import wait_until

from rayserve_apps.fast_ingress import (
    FAST_INGRESS_ENV,
    LOOPBACK_WRAPPER,
    QUEUE_TIMEOUT_MS,
    RUN_MARKER_ENV,
    end_marked_processes,
    haproxy_binary,
    ingress_queue_timeout_ms,
    ingress_turns,
    local_env,
    main,
    marked_processes,
    overload_errorfile,
)

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


def run_wrapper(tmp_path: Path, config_text: str, **env: str) -> tuple[str, list[str]]:
    """Runs the wrapper on `config_text` with a stand-in binary; returns the edited config and the binary's args."""
    config = tmp_path / "haproxy.cfg"
    config.write_text(config_text)
    seen = tmp_path / "args"
    binary = tmp_path / "haproxy"
    binary.write_text(f'#!/bin/sh\necho "$@" > {seen}\n')
    binary.chmod(0o755)
    subprocess.run([str(LOOPBACK_WRAPPER), "-db", "-f", str(config), "-sf", "123"], check=True,
                   env={"PLEXSERVE_HAPROXY_BINARY": str(binary), "PATH": "/usr/bin:/bin", **env})
    return config.read_text(), seen.read_text().split()


def test_the_wrapper_moves_every_listener_to_loopback_and_runs_the_binary_with_the_same_arguments(tmp_path):
    config, args = run_wrapper(tmp_path, SERVE_CONFIG)
    binds = re.findall(r"bind (\S+)", config)
    assert binds == ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:8404"]
    assert args == ["-db", "-f", str(tmp_path / "haproxy.cfg"), "-sf", "123"]


def test_the_wrapper_stamps_each_requests_arrival_unless_its_client_did(tmp_path):
    config, _ = run_wrapper(tmp_path, SERVE_CONFIG)
    lines = [line.strip() for line in config.splitlines()]
    stamp = ("http-request set-header X-Request-Start t=%[date(0,us)] unless { req.hdr(X-Request-Start) -m found }")
    assert lines[lines.index("frontend http_frontend") + 1] == stamp
    assert lines.count(stamp) == 1
    again, _ = run_wrapper(tmp_path, config)
    assert again.count("X-Request-Start t=") == 1
    checked = tmp_path / "checked.cfg"  # the real binary accepts the stamped frontend
    checked.write_text(f"defaults\n    mode http\nfrontend http_frontend\n    {stamp}\n    bind 127.0.0.1:8000\n")
    subprocess.run([haproxy_binary(), "-c", "-q", "-f", str(checked)], check=True)


#: Backend lines as Serve's template renders them: a replica, the backup fallback to Serve's proxy, a tracking server.
SERVE_BACKENDS = """defaults
    mode http
    errorfile 502 /tmp/serve/500.http
    errorfile 503 /tmp/serve/500.http
backend plexserve
    server r1 127.0.0.1:30001 check observe layer4 error-limit 10 on-error mark-down
    server fallback 127.0.0.1:8001 check backup
backend plexserve-via-ingress-request-router
    server r1 127.0.0.1:30001 track plexserve/r1
"""


def test_the_wrapper_caps_each_ingress_replica_and_answers_the_excess_with_plexserves_503(tmp_path):
    env = local_env(server_maxconn=72)
    settings = {k: v for k, v in env.items() if k.startswith("PLEXSERVE_HAPROXY") and k != "PLEXSERVE_HAPROXY_BINARY"}
    config, _ = run_wrapper(tmp_path, SERVE_BACKENDS, **settings)
    lines = [line.strip() for line in config.splitlines()]
    assert "server r1 127.0.0.1:30001 check observe layer4 error-limit 10 on-error mark-down maxconn 72" in lines
    assert "server fallback 127.0.0.1:8001 check backup" in lines
    assert "server r1 127.0.0.1:30001 track plexserve/r1" in lines
    assert lines[1] == f"timeout queue {env['PLEXSERVE_HAPROXY_QUEUE_TIMEOUT_MS']}ms"
    assert f"errorfile 503 {env['PLEXSERVE_HAPROXY_ERRORFILE_503']}" in lines
    assert "errorfile 502 /tmp/serve/500.http" in lines
    again, _ = run_wrapper(tmp_path, config, **settings)
    assert again.count("maxconn") == 1 and again.count("timeout queue") == 1


def test_without_a_cap_the_wrapper_leaves_the_backends_as_serve_renders_them(tmp_path):
    config, _ = run_wrapper(tmp_path, SERVE_BACKENDS)
    assert config == SERVE_BACKENDS


def test_haproxys_refusal_is_a_json_503_with_retry_after(tmp_path):
    head, body = overload_errorfile(tmp_path).read_bytes().split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json" and headers["retry-after"] == "1"
    assert int(headers["content-length"]) == len(body)
    assert json.loads(body)["error"]["type"] == "overloaded"


def test_the_cap_is_the_configs_ingress_turns(tmp_path):
    serving = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())["applications"][0]["args"]["serving"]
    assert ingress_turns(REPO / "configs" / "local.yaml") == serving["ingress_max_ongoing_requests"]
    unbounded = tmp_path / "serve.yaml"
    unbounded.write_text(yaml.safe_dump({"applications": [{"args": {"serving": {"ingress_max_queued_requests": -1,
                                                                                "ingress_max_ongoing_requests": 8}}}]}))
    assert ingress_turns(unbounded) is None
    following = tmp_path / "following.yaml"
    following.write_text(yaml.safe_dump({"applications": [{"args": {"serving": {
        "ingress_max_ongoing_requests": 8, "ingress_max_queued_requests": 4, "ingress_turns_slo_fraction": 0.5}}}]}))
    assert ingress_turns(following) == 8
    # HAProxy's queue waits what the gate allows (a quarter of the largest SLO, 1000 ms by default), else 500 ms.
    assert ingress_queue_timeout_ms(following) == 250 and ingress_queue_timeout_ms(unbounded) == QUEUE_TIMEOUT_MS
    following.write_text(yaml.safe_dump({"applications": [{"args": {
        "models": [{"slo_ms": 400}, {"slo_ms": 200}],
        "serving": {"ingress_max_ongoing_requests": 8, "ingress_max_queued_requests": 4,
                    "ingress_turns_slo_fraction": 0.5, "ingress_wait_slo_fraction": 0.5}}}]}))
    assert ingress_queue_timeout_ms(following) == 200
    assert local_env(server_maxconn=8, queue_timeout_ms=200)["PLEXSERVE_HAPROXY_QUEUE_TIMEOUT_MS"] == "200"
    with pytest.raises(ValueError, match="server_maxconn"):
        local_env(server_maxconn=0)


def test_a_runs_leftover_processes_are_found_by_their_marker_and_ended():
    marker = f"{os.getpid()}-test"
    leftover = subprocess.Popen(["sleep", "600"], env={**os.environ, RUN_MARKER_ENV: marker}, start_new_session=True)
    other = subprocess.Popen(["sleep", "600"], env={**os.environ, RUN_MARKER_ENV: marker + "-other"})
    try:
        wait_until(lambda: marked_processes(marker) == [leftover.pid], timeout_s=10, message="marked sleep not found")
        assert end_marked_processes(marker, grace_s=5) == [leftover.pid]
        assert leftover.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        for process in (leftover, other):
            process.kill()
            process.wait()


def test_launcher_without_a_config_says_how_to_call_it():
    with pytest.raises(SystemExit, match="usage: python -m rayserve_apps.fast_ingress CONFIG.yaml"):
        main([])


#: A stand-in for `serve run`: starts a child in a session of its own (as Serve starts HAProxy), writes its pid,
#: and on SIGINT writes that it got it and exits, leaving the child behind (or ignores SIGINT with `ignore`).
FAKE_SERVE_RUN = """
import pathlib, signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "600"], start_new_session=True)
def stop(*_):
    pathlib.Path(sys.argv[2]).write_text("SIGINT")
    if sys.argv[3] != "ignore":
        sys.exit(0)
signal.signal(signal.SIGINT, stop)
pathlib.Path(sys.argv[1]).write_text(str(child.pid))
while True:
    time.sleep(0.05)
"""


def launch_fake_serve_run(tmp_path: Path, mode: str, deadline_s: float) -> tuple[subprocess.Popen, int]:
    """`run_serve` over FAKE_SERVE_RUN in a process group of its own; returns it and the stand-in's child's pid."""
    fake = tmp_path / "fake_serve_run.py"
    fake.write_text(FAKE_SERVE_RUN)
    pid_file, got = tmp_path / "child.pid", tmp_path / "got"
    code = ("import os, sys; from rayserve_apps.fast_ingress import run_serve; "
            f"sys.exit(run_serve([sys.executable, {str(fake)!r}, {str(pid_file)!r}, {str(got)!r}, {mode!r}], "
            f"dict(os.environ), stop_deadline_s={deadline_s}))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True)
    child = wait_until(lambda: pid_file.exists() and pid_file.read_text() and int(pid_file.read_text()), timeout_s=60,
                       message="the stand-in did not start")
    return launcher, child


def test_a_stop_signal_becomes_serve_runs_ctrl_c_and_what_it_leaves_is_ended(tmp_path):
    launcher, child = launch_fake_serve_run(tmp_path, "exit", deadline_s=30)
    try:
        os.killpg(launcher.pid, signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        assert (tmp_path / "got").read_text() == "SIGINT"
        wait_until(lambda: not running(child), timeout_s=10, message="the run's leftover child is still there")
    finally:
        for pid in (launcher.pid, child):
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_serve_run_that_does_not_stop_is_killed_at_the_deadline(tmp_path):
    launcher, child = launch_fake_serve_run(tmp_path, "ignore", deadline_s=1)
    try:
        os.kill(launcher.pid, signal.SIGINT)
        assert launcher.wait(timeout=60) == 128 + signal.SIGKILL
        assert (tmp_path / "got").read_text() == "SIGINT"
        wait_until(lambda: not running(child), timeout_s=10, message="the run's leftover child is still there")
    finally:
        for pid in (launcher.pid, child):
            if running(pid):
                os.kill(pid, signal.SIGKILL)


#: The HTTP port of the stop test: the port `make serve` binds (configs/local.yaml), unless this variable names
#: another (for machines where 8000 is taken by something else).
STOP_TEST_PORT = int(os.environ.get("PLEXSERVE_STOP_TEST_PORT", "8000"))


def port_is_free(port: int) -> bool:
    """Whether a server can bind `port` on 127.0.0.1 now, as servers bind (SO_REUSEADDR: closed connections in
    TIME_WAIT do not count, a listener does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def haproxies_of(launcher_pid: int) -> list[int]:
    """HAProxy processes started by the run of the launcher `launcher_pid` (their environment carries its marker)."""
    found = []
    for pid in marked_processes_of(launcher_pid):
        try:
            program = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if Path(program.decode(errors="replace")).name == "haproxy":
            found.append(pid)
    return found


def small_local_config(path: Path, port: int) -> Path:
    """configs/local.yaml with minilm alone (no groups, no controller), on `port`."""
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["models"] = [model for model in args["models"] if model["name"] == "minilm"]
    for key in ("placement", "planning", "controller"):
        args.pop(key, None)
    path.write_text(yaml.safe_dump(config))
    return path


def child_of(parent_pid: int) -> int | None:
    try:
        children = Path(f"/proc/{parent_pid}/task/{parent_pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


#: Ports that neither the kernel hands out as ephemeral (32768 and up) nor Ray gives its workers (10002-19999): a
#: port drawn here and bound later by HAProxy is not taken meanwhile by a process of the Ray that starts first.
QUIET_PORTS = range(20000, 32768)


def quiet_ports(count: int) -> list[int]:
    """`count` distinct free ports of `QUIET_PORTS`."""
    chosen: list[int] = []
    for port in random.sample(QUIET_PORTS, len(QUIET_PORTS)):
        if port_is_free(port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"fewer than {count} free ports in {QUIET_PORTS}")


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie nobody reaps counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.ray
def test_sigterm_to_the_process_group_of_make_serve_leaves_no_haproxy_and_the_port_free(tmp_path):
    """As systemd and container runtimes stop a service: SIGTERM to every process of the group `make serve` runs
    in. The launcher runs under a parent that leads the group, as under make (`serve run` leaves the group it
    starts in when it starts Ray, so a launcher that became `serve run` would not get the signal). Afterwards no
    process of the run is left, no HAProxy among them, and the HTTP port can be bound again."""
    port = STOP_TEST_PORT
    if not port_is_free(port):
        pytest.fail(f"port {port} is taken before the test starts; stop what holds it or set PLEXSERVE_STOP_TEST_PORT")
    config = small_local_config(tmp_path / "local.yaml", port)
    stats_port, metrics_port = quiet_ports(2)
    env = {**os.environ, "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port)}
    launch = [sys.executable, "-m", "rayserve_apps.fast_ingress", str(config)]
    parent = f"import subprocess, sys; sys.exit(subprocess.call({launch!r}))"
    with open(tmp_path / "serve.log", "wb") as log:
        make = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    launcher = wait_until(lambda: child_of(make.pid), timeout_s=60, message="the launcher did not start")
    try:
        def serving() -> bool:
            assert running(launcher), (tmp_path / "serve.log").read_text()[-3000:]
            answer = requests.post(f"http://127.0.0.1:{port}/v1/models/minilm/embed", json={"texts": ["hi"]},
                                   timeout=30)
            return answer.status_code == 200 and bool(haproxies_of(launcher))

        wait_until(serving, timeout_s=600, interval_s=2, ignore=(requests.RequestException,),
                   message=lambda: (tmp_path / "serve.log").read_text()[-3000:])
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(timeout=60)
        wait_until(lambda: not running(launcher), timeout_s=120, message="the launcher outlived the SIGTERM")
        assert haproxies_of(launcher) == []
        assert marked_processes_of(launcher) == []
        assert port_is_free(port)
    finally:
        for pid in [launcher, *marked_processes_of(launcher)]:  # what a failed stop left
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if make.poll() is None:
            make.kill()
            make.wait()


def marked_processes_of(launcher_pid: int) -> list[int]:
    """Live processes of the run of launcher `launcher_pid` (their environment carries its marker)."""
    prefix = f"{RUN_MARKER_ENV}={launcher_pid}-".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(prefix) for v in environ) and running(int(entry.name)):
            found.append(int(entry.name))
    return found

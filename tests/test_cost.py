"""The cost and profile tools' own logic (load/processes.py, load/cost.py, load/profile.py), without a
server: which role each process of a Ray session gets, CPU seconds per conversation-second from
recorded snapshots, and py-spy's raw stacks folded into top frames."""
from __future__ import annotations

import pytest

from load import cost, profile
from load.processes import CPUSample, ProcInfo, role_of, session_roles

SESSION = "/tmp/ray/session_2026-12-03_19-03-24_581627_5921"
# what `ps` showed for `serve run serve_config.yaml` (command lines shortened), another Ray
# session's raylet and replica, and unrelated processes
TABLE = [
    ProcInfo(1, 0, "process_api", ("/process_api",)),
    ProcInfo(5921, 1, "serve", ("/work/main/.venv/bin/python", "/work/main/.venv/bin/serve", "run", "serve_config.yaml")),
    ProcInfo(5935, 5921, "gcs_server", (".../site-packages/ray/core/src/ray/gcs/gcs_server", f"--log_dir={SESSION}/logs")),
    ProcInfo(5967, 5921, "python", ("python", "-u", ".../ray/autoscaler/_private/monitor.py", f"--logs-dir={SESSION}/logs")),
    ProcInfo(5968, 5921, "python", ("python", ".../ray/dashboard/dashboard.py", f"--log-dir={SESSION}/logs")),
    ProcInfo(5999, 5968, "python", ("python", "-B", "-c", "from multiprocessing.resource_tracker import main;main(25)")),
    ProcInfo(6001, 5968, "ray-dashboard-MetricsHead-0", ("ray-dashboard-MetricsHead-0", "(python")),
    ProcInfo(6207, 5921, "python", ("python", "-u", ".../ray/_private/log_monitor.py", f"--session-dir={SESSION}")),
    ProcInfo(6208, 5921, "raylet", (".../site-packages/ray/core/src/ray/raylet/raylet",
                                    f"--raylet_socket_name={SESSION}/sockets/raylet")),
    ProcInfo(6231, 6208, "ray::DashboardAgent", ("ray::DashboardAgent", "")),
    ProcInfo(6303, 6208, "ray::ServeController", ("ray::ServeController.listen_for_change", "")),
    ProcInfo(6304, 6208, "ray::ProxyActor", ("ray::ProxyActor", "")),
    ProcInfo(6397, 6208, "ray::ServeReplica:gapless:STT", ("ray::ServeReplica:gapless:STT", "")),
    ProcInfo(6468, 6208, "ray::ServeReplica:gapless:LLM", ("ray::ServeReplica:gapless:LLM", "")),
    ProcInfo(6469, 6208, "ray::ServeReplica:gapless:TTS", ("ray::ServeReplica:gapless:TTS", "")),
    ProcInfo(6470, 6469, "python", ("python", "-c", "compile worker")),
    ProcInfo(6497, 6208, "ray::ServeReplica:gapless:TicketLedger", ("ray::ServeReplica:gapless:TicketLedger", "")),
    ProcInfo(6526, 6208, "ray::ServeReplica:gapless:Gateway", ("ray::ServeReplica:gapless:Gateway", "")),
    ProcInfo(6600, 6208, "ray::IDLE", ("ray::IDLE", "")),
    # another session (a test's cluster, started by `ray start`): not ours
    ProcInfo(7000, 1, "raylet", (".../raylet", "--raylet_socket_name=/tmp/ray/session_2026-12-04_08-00-00_1_7/x")),
    ProcInfo(7001, 7000, "ray::ServeReplica:gapless:TTS", ("ray::ServeReplica:gapless:TTS", "")),
    # a shell that merely mentions our session and a replica's title is not Ray's
    ProcInfo(8000, 1, "bash", ("bash",)),
    ProcInfo(8001, 8000, "grep", ("grep", "ray::ServeReplica:gapless:Gateway")),
]


def test_role_of_titles_and_executables():
    assert role_of("ray::ServeReplica:gapless:Gateway", ("ray::ServeReplica:gapless:Gateway", "")) == "gateway"
    assert role_of("ray::ServeController", ("ray::ServeController.listen_for_change",)) == "controller"
    assert role_of("raylet", (".../raylet", "--x")) == "raylet"
    assert role_of("gcs_server", ("/x/gcs_server",)) == "gcs"
    assert role_of("grep", ("grep", "ray::ServeReplica:gapless:Gateway")) is None  # a mention is not a title
    assert role_of("ray::DashboardAgent", ("ray::DashboardAgent",)) is None


def test_every_process_of_the_session_gets_one_role_and_others_none():
    roles = session_roles(TABLE)
    assert roles == {
        5921: "other_ray", 5935: "gcs", 5967: "other_ray", 5968: "other_ray", 5999: "other_ray", 6001: "other_ray",
        6207: "other_ray", 6208: "raylet", 6231: "other_ray", 6303: "controller", 6304: "proxy", 6397: "stt",
        6468: "llm", 6469: "tts", 6470: "tts", 6497: "tickets", 6526: "gateway", 6600: "other_ray"}


def test_no_gateway_no_session():
    assert session_roles([p for p in TABLE if p.pid != 6526]) == {}


def test_cpu_per_conversation_second_from_recorded_snapshots():
    before = {1: CPUSample("tts", 100.0, 5.0), 2: CPUSample("gateway", 10.0, 5.0),
              3: CPUSample("llm", 50.0, 5.0),  # ends during the level: its last seconds are unread
              4: CPUSample("stt", 70.0, 5.0)}  # its pid is reused by a new process (started 9.0)
    after = {1: CPUSample("tts", 148.0, 5.0), 2: CPUSample("gateway", 13.0, 5.0),
             4: CPUSample("stt", 2.0, 9.0), 5: CPUSample("other_ray", 1.0, 8.0)}
    spent = cost.spent(before, after)
    assert spent["tts"] == 48.0 and spent["gateway"] == 3.0 and spent["stt"] == 2.0 and spent["other_ray"] == 1.0
    assert spent["llm"] == 0.0 and spent["raylet"] == 0.0
    # 4 conversations for 20 s = 80 conversation-seconds; 48 + 3 + 2 + 1 = 54 CPU s
    rates = cost.per_second(spent, 4, 20.0)
    assert rates["tts"] == pytest.approx(0.6) and rates["gateway"] == pytest.approx(0.0375)
    assert rates["total"] == pytest.approx(54 / 80)


def test_py_spy_raw_stacks_to_top_frames():
    raw = ("Thread.run (threading.py:971);main (app.py:1);loop (app.py:5);step (tts.py:10) 30\n"
           "Thread.run (threading.py:971);main (app.py:1);loop (app.py:5);decode (mimi.py:3) 10\n"
           "Thread.run (threading.py:971);main (app.py:1);rec (r.py:1);rec (r.py:1) 5\n"
           "garbage line\n")
    stacks = profile.parse_raw(raw)
    assert sum(stacks.values()) == 45
    top = profile.top_frames(stacks, 3)
    assert top["own"] == [("step (tts.py:10)", 30), ("decode (mimi.py:3)", 10), ("rec (r.py:1)", 5)]
    # thread start-up (threading.py) is under every stack: not ranked by total time
    assert top["total"] == [("main (app.py:1)", 45), ("loop (app.py:5)", 40), ("step (tts.py:10)", 30)]
    assert dict(profile.top_frames(stacks, 10)["total"])["rec (r.py:1)"] == 5  # recursion counts once

"""W&B telemetry never stops serving: what happens without a network, a writable directory or wandb."""

from __future__ import annotations

import sys
import time

import pytest

from osd_serve import telemetry
from osd_serve.telemetry import Telemetry

pytest.importorskip("wandb")


def test_auto_mode_follows_wandbs_own_switches(monkeypatch):
    """With a key set, auto went online whatever WANDB_MODE said: an air-gapped cluster's
    WANDB_MODE=offline still waited minutes for the server, then failed the replica."""
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    for env, mode in (("offline", "offline"), ("disabled", "disabled"), ("dryrun", "offline"), ("", "online")):
        monkeypatch.setenv("WANDB_MODE", env)
        assert telemetry._auto_mode() == mode
    monkeypatch.setenv("WANDB_DISABLED", "true")
    assert telemetry._auto_mode() == "disabled"
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_DISABLED")
    monkeypatch.setenv("WANDB_MODE", "")
    assert telemetry._auto_mode() == "offline"


def test_an_unreachable_server_falls_back_to_offline(monkeypatch, tmp_path):
    """wandb.init(mode="online") without a network raised CommError after ~100 s, and the replica
    never started. Now it is bounded (init_timeout) and the run continues offline."""
    import wandb

    real, modes = wandb.init, []

    def init(mode, settings, **kw):
        modes.append((mode, settings.init_timeout))
        if mode == "online":
            raise wandb.errors.CommError("Timed out while retrying: no such host")
        return real(mode=mode, settings=settings, **kw)

    monkeypatch.setattr(wandb, "init", init)
    with pytest.warns(UserWarning, match="logging offline instead"):
        t = Telemetry("online", directory=str(tmp_path), log_every_s=0.0)
    assert modes == [("online", telemetry.INIT_TIMEOUT_S), ("offline", telemetry.INIT_TIMEOUT_S)]
    assert t.run is not None and t.run.settings.mode == "offline"
    t.close()


def test_no_directory_or_no_wandb_turns_wandb_off_not_serving(monkeypatch, tmp_path):
    """An unwritable W&B directory, or wandb missing (it is in the serve extra, not the core), raised out
    of the service's constructor. Now W&B is off with a warning and the history still fills."""
    (tmp_path / "file").write_text("")
    with pytest.warns(UserWarning, match="cannot create its directory"):
        t = Telemetry("offline", directory=str(tmp_path / "file" / "wandb"), log_every_s=0.0)
    t.on_event("default", version=0)
    assert t.run is None and t.maybe_log(force=True) is not None and len(t.recent()) == 1
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.warns(UserWarning, match="wandb is not installed"):
        assert Telemetry("auto", directory=str(tmp_path)).run is None
    with pytest.raises(ImportError, match="osd-serve\\[serve\\]"):  # asked for by name: an error
        Telemetry("offline", directory=str(tmp_path))


def test_history_is_bounded():
    """Every logged row was kept for the replica's lifetime (3.5 KB a row, every 10 s, per replica)."""
    t = Telemetry("disabled", log_every_s=0.0)
    for i in range(telemetry.HISTORY_ROWS + 100):
        t.on_event("default", version=i)
        t.maybe_log(force=True)
    rows = t.recent()
    assert len(rows) == telemetry.HISTORY_ROWS and rows[-1]["version/default"] == telemetry.HISTORY_ROWS + 99
    assert rows[0]["time"] <= time.time()


def test_every_event_of_a_window_is_logged():
    """Events went into the window's row under one key each: a rollback to 0 and a publish of 2 in one
    window logged only version 2."""
    t = Telemetry("disabled", log_every_s=3600.0)
    t.on_event("sql", version=0, rollback=1)
    t.on_event("sql", version=2, published=1)
    t.maybe_log(force=True)
    rows = t.recent()
    assert [r.get("version/sql") for r in rows] == [0, 2] and rows[0]["rollback/sql"] == 1


def test_an_idle_window_adds_no_row():
    """Every window closed a row, data or none: an idle replica added one every log_every_s, and each
    /admin/metrics call one more, so within hours the bounded history held only {"time": ...} rows
    and the last acceptance and latency rows were gone (and W&B got an empty step each time)."""
    t = Telemetry("disabled", log_every_s=3600.0)
    t.on_request("default", 1.5, "stop")
    assert t.maybe_log(force=True)["latency_p50_s"] == 1.5
    for _ in range(telemetry.HISTORY_ROWS + 1):
        assert t.maybe_log(force=True) == {"time": pytest.approx(time.time(), abs=60)}  # closed, not kept
    t.on_event("default", loss=float("nan"))  # an event with no finite field: nothing to keep either
    t.maybe_log(force=True)
    assert [r["latency_p50_s"] for r in t.recent()] == [1.5]


def test_latency_counts_requests_that_ran_to_their_end():
    """An aborted request (its client went away) or a failed one is left out of the latency
    percentiles; the colocated service counted neither, the disaggregated router both."""
    t = Telemetry("disabled", log_every_s=3600.0)
    for lat, finish in ((1.0, "length"), (2.0, "stop"), (100.0, None), (50.0, "error"), (70.0, "abort")):
        t.on_request("default", lat, finish)
    t.maybe_log(force=True)
    row = t.recent()[-1]
    assert row["latency_p50_s"] >= 1.0 and row["latency_p99_s"] <= 2.0, row


def test_latency_percentiles_are_nearest_rank():
    """int(q * n) read one rank high: p50 of 1..4 was 3, and p99 of fewer than 100 latencies the maximum."""
    assert telemetry._percentile([4, 1, 3, 2], 0.5) == 2 and telemetry._percentile(list(range(1, 101)), 0.99) == 99
    assert telemetry._percentile([7.0], 0.99) == 7.0 and telemetry._percentile([], 0.5) is None


def test_the_last_row_is_written_before_the_run_finishes(tmp_path):
    """close() did not wait for the timer: a row it was writing could reach W&B after finish(), which
    refuses it, and the window was lost."""
    t = Telemetry("offline", directory=str(tmp_path), log_every_s=1.0)
    order, real_log, real_finish = [], t.run.log, t.run.finish
    delays = [0.8]  # the first write (the timer's) is slow: it is mid-write when close() comes

    def slow_log(row, *a, **k):
        time.sleep(delays.pop() if delays else 0.0)
        order.append("log")
        return real_log(row, *a, **k)

    t.run.log = slow_log
    t.run.finish = lambda *a, **k: (order.append("finish"), real_finish(*a, **k))[1]
    t.on_event("default", version=1)
    time.sleep(1.2)  # the timer's first window has begun writing
    t.close()
    time.sleep(1.0)  # a write still under way would land now
    assert order[-1] == "finish" and order.count("finish") == 1 and "log" in order, order


def test_events_reach_wandb_without_traffic(tmp_path):
    """Rows were written only when the engine stepped: with no traffic, a version the distiller
    published waited for the next request. A W&B run now gets each window on time."""
    t = Telemetry("offline", directory=str(tmp_path), log_every_s=1.0)
    try:
        logged = []
        real = t.run.log
        t.run.log = lambda row, *a, **k: (logged.append(row), real(row, *a, **k))
        t.on_event("default", version=3, published=1)
        deadline = time.time() + 10
        while not any(r.get("version/default") == 3 for r in logged) and time.time() < deadline:
            time.sleep(0.1)
        assert any(r.get("version/default") == 3 for r in logged)
    finally:
        t.close()


def test_a_dead_wandb_service_does_not_fail_steps_or_shutdown():
    """With wandb's service process gone (OOM-killed), run.log raised ConnectionResetError out of
    on_step: the disaggregated Verifier calls it inside its verify batch, which failed every request in
    it; /admin/metrics and close() raised too. W&B now goes off and the rows still reach the history.
    While a run is open the engine's steps never write to it (the timer does): a stalled W&B service
    stalled every step."""

    class DeadRun:
        def __init__(self):
            self.calls = 0

        def log(self, row):
            self.calls += 1
            raise ConnectionResetError("Connection lost")

        def finish(self):
            raise ConnectionResetError("Connection lost")

    class Step:
        proposed, accepted, rejected, emitted, batch_size = 4, 2, 1, 3, 1
        accepted_per_position, proposed_per_position, tested_per_position = [1, 1], [1, 1], [1, 1]

    t = Telemetry("disabled", log_every_s=0.0)
    t.run = dead = DeadRun()
    t.on_step("default", Step())
    assert dead.calls == 0 and t.recent() == []  # the step wrote nothing: the timer (or a forced log) does
    t.maybe_log()  # the timer closes the window and writes it: the write raised ConnectionResetError
    t._send()
    assert dead.calls == 1 and t.run is None and t.recent()[-1]["alpha/default"] == 2 / 3
    t.on_step("default", Step())  # W&B off: the step writes its row to the history
    assert dead.calls == 1 and len(t.recent()) == 2  # no further calls into the dead service
    t.run = DeadRun()
    t.close()  # run.finish() raised out of the replica's shutdown
    assert t.run is None


def test_a_window_reports_the_batch_and_the_k_auto_chose():
    from osd_serve.engine import StepStats

    t = Telemetry("disabled", log_every_s=3600.0)
    for k, rows in ((1, 8), (3, 2), (None, 4)):  # None: a step with no "auto" row
        t.on_step("default", StepStats(rows, 0, 0, 0, [], [], rows, 0.0, 0.0, 0.0, k))
    row = t.maybe_log(force=True)
    assert row["auto_k/default"] == 2.0 and row["batch_size/default"] == pytest.approx(14 / 3)
    t.close()


def test_each_window_starts_empty_and_p99_is_not_the_maximum():
    """A row holds its own window only: latencies and per-position acceptance logged once are not
    carried into the next row; p99 of 100 latencies is the 99th, not the slowest."""
    from osd_serve.engine import StepStats

    t = Telemetry("disabled", log_every_s=3600.0)
    for i in range(1, 101):
        t.on_request("default", float(i), "stop")
    t.on_step("default", StepStats(1, 2, 1, 1, [1, 0], [1, 1], 2, 0.0, 0.0, 0.0, None, [1, 1]))
    row = t.maybe_log(force=True)
    assert (row["latency_p50_s"], row["latency_p99_s"]) == (50.0, 99.0), row
    assert row["alpha_pos/default/0"] == 1.0 and row["alpha_pos/default/1"] == 0.0, row
    row = t.maybe_log(force=True)
    assert not any(k.startswith(("latency", "alpha")) for k in row), row
    t.on_step("default", StepStats(1, 1, 0, 1, [0], [1], 1, 0.0, 0.0, 0.0, None, [1]))  # the next window's own step
    row = t.maybe_log(force=True)
    assert row["alpha_pos/default/0"] == 0.0 and "alpha_pos/default/1" not in row, row
    t.close()


def test_prometheus_is_a_no_op_outside_ray():
    """Outside a Ray worker the counters are off: creating Ray metrics there would start (or need) a
    cluster just for counters. Steps and requests still fill the W&B rows."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray cluster is up in this process")
    from osd_serve.engine import StepStats

    t = Telemetry("disabled", log_every_s=3600.0)
    assert t.prom.ok is False
    t.on_step("default", StepStats(1, 1, 1, 0, [1], [1], 2, 0.0, 0.0, 0.0, None))
    t.on_request("default", 0.5, "stop")
    row = t.maybe_log(force=True)
    assert row["alpha/default"] == 1.0 and row["latency_p50_s"] == 0.5 and not ray.is_initialized()
    t.close()


def test_per_position_alpha_is_accepted_over_tested():
    """alpha_pos/<e>/<j> was accepted / proposed: a draft after a rejection counted as rejected though
    never tested, so positions past 0 read about α^(j+1), not α. Here one row accepts all 4 drafts and
    one is rejected at position 0: positions 1-3 were tested once and accepted."""
    from osd_serve.disagg import Sampling, TargetVerifier, Verdict, VerifyItem

    items = [VerifyItem(f"s{i}", [1], [5, 6, 7, 8], None, Sampling()) for i in range(2)]
    verdicts = [Verdict([5, 6, 7, 8, 9], 4, 0), Verdict([3], 0, 0)]
    st = TargetVerifier._stats(items, verdicts, 0.0)["default"]  # the disaggregated topology's counts
    assert st.tested_per_position == [2, 1, 1, 1] and st.proposed_per_position == [2, 2, 2, 2]
    t = Telemetry("disabled", log_every_s=3600.0)
    t.on_step("default", st)
    row = t.maybe_log(force=True)
    assert row["alpha/default"] == 0.8
    assert [row[f"alpha_pos/default/{j}"] for j in range(4)] == [0.5, 1.0, 1.0, 1.0]
    t.close()


def test_a_nan_event_value_is_left_out_of_the_rows():
    """The guard's NaN-acceptance verdict keeps expected_acceptance = nan: logged as heldout_alpha_hat, it
    made /admin/metrics' JSON (no NaN there) answer 500 until 500 newer rows pushed it out."""
    import json

    t = Telemetry("disabled", log_every_s=3600.0)
    t.on_event("default", version=None, published=0, loss=0.3, heldout_alpha_hat=float("nan"), worst=float("-inf"))
    t.maybe_log(force=True)
    event = t.recent()[0]
    assert event["loss/default"] == 0.3 and event["published/default"] == 0
    assert "heldout_alpha_hat/default" not in event and "worst/default" not in event
    json.dumps(t.recent(), allow_nan=False)  # what the route's encoder does
    t.close()


def test_prometheus_counts_tested_tokens_so_alpha_needs_no_gauge():
    """osd_alpha is a gauge of the last window: it stays put once traffic stops, and averaging it over
    replicas is wrong. The tested counter makes rate(accepted) / rate(tested) the α of any range."""
    from types import SimpleNamespace

    from osd_serve.engine import StepStats
    from osd_serve.telemetry import _Prometheus

    counts = {}

    def counter(name):
        return SimpleNamespace(inc=lambda v, tags: counts.__setitem__((name, tags["expert"]), counts.get((name, tags["expert"]), 0) + v))

    prom = object.__new__(_Prometheus)
    prom.ok = True
    prom.draft, prom.accepted, prom.emitted, prom.tested = map(counter, ("draft", "accepted", "emitted", "tested"))
    prom.step("sql", StepStats(2, 8, 4, 1, [1, 1, 1, 1], [2, 2, 2, 2], 6, 0.0, 0.0, 0.0, None, [2, 1, 1, 1]))
    prom.step("sql", StepStats(1, 3, 3, 0, [1, 1, 1], [1, 1, 1], 4, 0.0, 0.0, 0.0, None, [1, 1, 1]))
    assert counts == {("draft", "sql"): 11, ("accepted", "sql"): 7, ("emitted", "sql"): 10, ("tested", "sql"): 8}


def test_a_hung_wandb_write_blocks_neither_admin_metrics_nor_shutdown(tmp_path, monkeypatch):
    """/admin/metrics forces a window closed on the replica's event loop. It also wrote the window to
    W&B there, waiting for the timer's write: a W&B call that hung froze every stream on that loop. And
    close() waited forever on a hung last write or finish(). Only the timer (and close(), bounded)
    write now; a forced window goes to the history at once and to W&B at the timer's next tick."""
    import threading

    monkeypatch.setattr(telemetry, "CLOSE_TIMEOUT_S", 1.0, raising=False)
    t = Telemetry("offline", directory=str(tmp_path), log_every_s=1.0)
    run, hang, entered = t.run, threading.Event(), threading.Event()
    real_log, real_finish = run.log, run.finish

    def hung_log(row, *a, **k):
        entered.set()
        hang.wait(60)
        return real_log(row, *a, **k)

    run.log = hung_log
    try:
        t.on_event("default", version=1)
        assert entered.wait(10)  # the timer is inside run.log, holding the writer's lock
        t.on_request("default", 0.5, "stop")
        forced = threading.Thread(target=lambda: t.maybe_log(force=True), daemon=True)
        forced.start()
        forced.join(5)
        assert not forced.is_alive(), "a forced window waited on the hung W&B write"
        assert t.recent()[-1]["latency_p50_s"] == 0.5  # in the history at once
        start = time.monotonic()
        t.close()  # the timer is stuck: close gives up on it after CLOSE_TIMEOUT_S
        assert time.monotonic() - start < 5
    finally:
        hang.set()
        real_finish()

    t2 = Telemetry("offline", directory=str(tmp_path / "2"), log_every_s=60.0)
    real_finish2, hang2 = t2.run.finish, threading.Event()
    t2.run.finish = lambda *a, **k: hang2.wait(60)
    try:
        t2.on_event("default", version=2)
        start = time.monotonic()
        t2.close()  # the last rows are written, then finish() hangs: close returns all the same
        assert time.monotonic() - start < 5
    finally:
        hang2.set()
        real_finish2()


def test_a_busy_windows_percentiles_sample_all_its_requests():
    """The window kept the latest 2000 latencies: 1000 requests at 10 s then 2000 at 1 s read p99 1.0,
    the slow third of the window gone. A uniform sample of all of them keeps it."""
    t = Telemetry("disabled", log_every_s=3600.0)
    for latency in [10.0] * 1000 + [1.0] * 2000:
        t.on_request("default", latency, "length")
    row = t.maybe_log(force=True)
    assert (row["latency_p50_s"], row["latency_p99_s"]) == (1.0, 10.0)
    assert len(t._lat) == 0 and t._n_lat == 0  # the next window starts empty


def test_a_forced_window_reaches_wandb_without_waiting_for_the_next_tick(tmp_path):
    """Only the timer writes to W&B, so a window /admin/metrics closes wakes it: with log_every_s 3600
    the forced rows otherwise waited an hour to reach the run (the e2e test's W&B check found none)."""
    t = Telemetry("offline", directory=str(tmp_path), log_every_s=3600.0)
    try:
        logged, real = [], t.run.log
        t.run.log = lambda row, *a, **k: (logged.append(row), real(row, *a, **k))
        t.on_event("default", version=4)
        t.maybe_log(force=True)
        deadline = time.time() + 10
        while not any(r.get("version/default") == 4 for r in logged) and time.time() < deadline:
            time.sleep(0.05)
        assert any(r.get("version/default") == 4 for r in logged), logged
    finally:
        t.close()

"""From a review of the disaggregated request path (DisaggBackend behind the HTTP API, and the Verifier),
over the in-process handles of test_disagg_deployment.py: a failure before the first token answers as
the colocated topology does (503 for a full queue, 500 otherwise, before any 200), a server-side set-up
failure is not the client's 400, a release refused by a full queue is sent again, and a verify that a
release overtook leaves no target row behind."""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError, RayTaskError  # noqa: E402
from ray.serve.exceptions import BackPressureError  # noqa: E402

from deployments.api import make_app  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from tests.test_disagg_deployment import _backend  # noqa: E402

CFG = AppConfig(distill={"enabled": False})
BODY = {"prompt": "def g(", "max_tokens": 12, "ignore_eos": True, "temperature": 0}


def _full() -> BackPressureError:
    return BackPressureError(num_queued_requests=4, max_queued_requests=4)


def _failing(handle, method: str, errors: list) -> list:
    """The handle's method raises errors[i] at its i-th call (None: the real call). Returns the calls' args."""
    real, calls = handle.methods[method], []

    async def call(*args, **kwargs):
        calls.append(args)
        if len(calls) <= len(errors) and errors[len(calls) - 1] is not None:
            raise errors[len(calls) - 1]
        return await real(*args, **kwargs)

    handle.methods[method] = call
    return calls


def _serve(backend, body: dict, settle=lambda: True) -> httpx.Response:
    """POSTs a completion, then keeps the loop running until settle() (the releases run after the response)."""
    async def run():
        transport = httpx.ASGITransport(app=make_app(backend, CFG))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json=body)
        for _ in range(500):
            if settle():
                break
            await asyncio.sleep(0.01)
        return r
    return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("where", ["propose", "verify"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_queue_at_the_first_step_is_a_503(tok, where, stream):
    """Serve's max_queued_requests refusal became an error chunk: a 500, or a 200 stream with an error
    event, and a logged traceback per refused request. Colocated answers 503, as README says."""
    backend, _, verifier = _backend(tok, CFG)
    _failing(backend.drafts if where == "propose" else backend.verifier, where, [_full()])
    r = _serve(backend, BODY | {"stream": stream}, lambda: verifier.ends)
    assert r.status_code == 503 and "capacity" in r.json()["error"]["message"], r.text
    assert r.headers["retry-after"] == "1"  # when to come back; the openai SDK's retries follow it
    assert [finish for _, finish, _ in verifier.ends] == ["error"]  # released on both sides, as failed


@pytest.mark.parametrize("error", [
    lambda: ActorDiedError(),  # the Verifier replica died
    lambda: RayTaskError("Verifier.verify", "Traceback (pid=4242, ip=10.0.0.7)", ValueError("x")).as_instanceof_cause(),
    lambda: ValueError("raised in the router's own loop"),  # a bug's ValueError, not bad input: never a 400
])
def test_a_failed_first_step_is_a_500_before_any_200(tok, error):
    backend, _, verifier = _backend(tok, CFG)
    _failing(backend.verifier, "verify", [error()])
    r = _serve(backend, BODY | {"stream": True}, lambda: verifier.ends)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "pid=" not in r.text and "router's own loop" not in r.text
    assert [finish for _, finish, _ in verifier.ends] == ["error"]


def test_a_failed_later_step_still_ends_the_stream_with_an_error_event(tok):
    backend, _, verifier = _backend(tok, CFG)
    _failing(backend.verifier, "verify", [None, None, ActorDiedError()])
    r = _serve(backend, BODY | {"stream": True, "max_tokens": 40}, lambda: verifier.ends)
    events = r.text.strip().split("\n\n")
    assert r.status_code == 200 and '"error"' in events[-2] and events[-1] == "data: [DONE]"
    assert [finish for _, finish, _ in verifier.ends] == ["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_queue_at_a_later_step_is_a_503_and_logs_no_traceback(tok, caplog, stream):
    """Each step of a disaggregated request is a call that a full queue can refuse. Past the first token
    a whole completion answered 500 and logged a traceback per refused request; a stream ends with the
    503's error event."""
    backend, _, verifier = _backend(tok, CFG)
    _failing(backend.verifier, "verify", [None, _full()])
    with caplog.at_level("ERROR"):
        r = _serve(backend, BODY | {"stream": stream, "max_tokens": 40}, lambda: verifier.ends)
    if stream:
        events = r.text.strip().split("\n\n")
        assert r.status_code == 200 and "capacity" in events[-2] and events[-1] == "data: [DONE]"
    else:
        assert r.status_code == 503 and "capacity" in r.json()["error"]["message"], r.text
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert [finish for _, finish, _ in verifier.ends] == ["error"]


def test_a_router_set_up_failure_is_a_500_without_the_model_paths(tmp_path, monkeypatch):
    """The Router loads the tokenizer at its first request; a path missing on the Router's node was a
    400 invalid_request_error quoting the server's model directory (which /health keeps to itself)."""
    import deployments.disagg as dd

    for role in ("target", "draft"):
        (tmp_path / "secret" / role).mkdir(parents=True)
    cfg = AppConfig(target=str(tmp_path / "secret/target"), draft=str(tmp_path / "secret/draft"),
                    distill={"enabled": False}, topology="disaggregated")
    shutil.rmtree(tmp_path / "secret")  # the Router's node lacks what the node that built the app had
    monkeypatch.setattr(dd.serve, "get_replica_context", lambda: SimpleNamespace(app_name="osd"))
    monkeypatch.setattr(dd.serve, "get_deployment_handle", lambda name, app: None)
    r = _serve(dd.DisaggBackend(cfg), BODY)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "secret" not in r.text, r.text


def test_a_release_refused_by_a_full_queue_is_sent_again(tok):
    """Releases share the handles, so the load that fills a queue refused them too, and a refused one
    was only logged: the Verifier counted the sequence running for 10 minutes and kept its rows."""
    backend, worker, verifier = _backend(tok, CFG)
    drafts = _failing(backend.drafts, "release", [])
    targets = _failing(backend.verifier, "release", [_full(), _full()])
    r = _serve(backend, BODY, lambda: verifier.ends)
    assert r.status_code == 200
    assert len(targets) == 3 and len(verifier.ends) == 1  # refused twice, then done
    assert len(drafts) == 1  # the side that was not refused is not sent again
    assert not worker.caches.tokens and not verifier.caches.tokens


def test_a_release_refused_every_time_gives_up_after_its_last_try(tok, monkeypatch):
    import deployments.disagg as dd

    backend, _, verifier = _backend(tok, CFG)
    targets = _failing(backend.verifier, "release", [_full()] * dd.RELEASE_TRIES)
    sleeps, sleep = [], asyncio.sleep
    monkeypatch.setattr(dd.asyncio, "sleep", lambda s: (sleeps.append(s), sleep(0))[1])
    assert _serve(backend, BODY, lambda: len(targets) == dd.RELEASE_TRIES).status_code == 200
    assert len(targets) == dd.RELEASE_TRIES and not verifier.ends
    retry_sleeps = [t for t in sleeps if t != 0.01]  # _serve's own polling sleeps 0.01
    assert retry_sleeps == [0.05 * 2 ** i for i in range(dd.RELEASE_TRIES - 1)]  # none after the last try


def test_a_verify_that_its_release_overtook_leaves_no_target_row(monkeypatch):
    """release is not batched: for a client gone away it reaches the torch thread ahead of a verify
    still in the @serve.batch queue, which then rebuilt the whole row, held until it idled out (120 s)."""
    import deployments.disagg as dd
    from osd_serve.disagg import Sampling, VerifyItem
    from tests.conftest import llama

    monkeypatch.setattr(dd, "_load", lambda cfg, role: (llama(50, hidden=16, layers=1), 50, 256))
    monkeypatch.setattr(dd.serve, "get_replica_context", lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1")))
    v = dd.Verifier.func_or_class(AppConfig(distill={"enabled": False}, wandb={"mode": "disabled"}).model_dump())
    verify = type(v).verify.__wrapped__  # the batch body Serve calls
    history = list(range(3, 40))

    async def run():
        [out] = await verify(v, [VerifyItem("seq-1", history, [4, 5], None, Sampling(), "default", 5)])
        await v.release("seq-1", "default", 0.1)  # overtakes step 2's verify, still queued
        await verify(v, [VerifyItem("seq-1", history + out.tokens, [6], None, Sampling(), "default", 5)])
        await verify(v, [VerifyItem("seq-2", [7, 8, 9], [4], None, Sampling(), "default", 2)])

    asyncio.run(run())
    assert "seq-1" not in v.core.caches.tokens and "seq-1" not in v.core.caches._rows
    assert "seq-2" in v.core.caches.tokens  # a sequence not released keeps its row


def _unknown_on_replica() -> Exception:
    """What the Router gets from a DraftPool replica that lacks the expert: the replica's UnknownExpert,
    inside a RayTaskError (pickled across, as Ray sends it)."""
    import pickle

    from osd_serve.protocol import UnknownExpert

    cause = pickle.loads(pickle.dumps(UnknownExpert("default", ["sql"])))
    return RayTaskError("DraftPool.propose", "Traceback (pid=4242, ip=10.0.0.7)", cause).as_instanceof_cause()


@pytest.mark.parametrize("wrapped", [True, False], ids=["through_ray", "in_process"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_draft_replica_lacking_the_expert_is_a_503_to_retry(tok, stream, wrapped):
    """During a rolling redeploy an old DraftPool replica lacks an expert the new Router knows. It answered
    a 500 (its error came as a RayTaskError), then a 400 "unknown expert" for an expert the server's config
    has: the request is valid, and a retry reaches a replica holding it."""
    backend, _, verifier = _backend(tok, CFG)
    _failing(backend.drafts, "propose", [_unknown_on_replica() if wrapped else _unknown_on_replica().cause])
    r = _serve(backend, BODY | {"stream": stream}, lambda: verifier.ends)
    err = r.json()["error"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert err["param"] == "expert" and err["code"] == "expert_not_loaded" and err["type"] == "server_error", r.text
    assert err["message"].startswith("expert: 'default' is not loaded on the replica this request reached"), r.text
    assert "['sql']" in err["message"] and "pid=" not in r.text


def test_the_draft_pool_refuses_an_expert_it_lacks_as_unknown_expert():
    """The type the Router tells apart (a bug's ValueError stays a 500), raised before any load."""
    from deployments.disagg import DraftPool
    from osd_serve.protocol import UnknownExpert

    pool = object.__new__(DraftPool.func_or_class)
    pool.adapters = {"sql": None}
    with pytest.raises(UnknownExpert) as got:
        asyncio.run(DraftPool.func_or_class.get_worker.__wrapped__(pool, "default"))
    assert (got.value.expert, got.value.known) == ("default", ["sql"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_draft_replica_lacking_the_expert_at_a_later_step_is_a_503_too(tok, stream):
    """Each propose is routed anew by multiplexing, so a later step can reach an old DraftPool replica:
    a whole completion answered a 500 (logged as an engine failure) where a full queue there is a 503."""
    backend, _, verifier = _backend(tok, CFG)
    _failing(backend.drafts, "propose", [None, _unknown_on_replica()])
    r = _serve(backend, BODY | {"stream": stream}, lambda: verifier.ends)
    body = r.text if stream else r.json()["error"]
    if stream:
        assert r.status_code == 200 and '"code": "expert_not_loaded"' in body, body
    else:
        assert r.status_code == 503 and body["code"] == "expert_not_loaded" and r.headers["retry-after"] == "1", r.text


@pytest.mark.parametrize("verifier", ["told", "fails", "hangs"])
def test_a_rollback_tells_the_verifier_and_survives_its_failure(tmp_path, monkeypatch, caplog, verifier):
    """Disaggregated, a rollback rolled the shared store back and wrote no event row: the Verifier, which
    logs the versions, saw nothing until proposals of the version came. It is now told (note_rollback);
    one that fails or never answers (no replica running: Serve queues the
    call) leaves the rollback done and answered, with a warning. A Router not set up yet rolls back too."""
    import torch

    import deployments.disagg as dd
    from osd_serve.distill.versions import VersionStore

    monkeypatch.setattr(dd, "replica_app", lambda: "app1")
    monkeypatch.setattr(dd, "NOTE_TIMEOUT_S", 0.2)
    cfg = AppConfig(distill={"backend": "ray_train", "versions_dir": str(tmp_path)})
    store = VersionStore(tmp_path / "app1" / "sql")
    for i in range(3):
        store.publish({"w": torch.full((2,), float(i))})
    told, handles = [], []

    async def note_rollback(*args):
        if verifier == "fails":
            raise RuntimeError("Verifier replica gone")
        if verifier == "hangs":
            await asyncio.sleep(3600)
        told.append(args)

    handle = SimpleNamespace(note_rollback=SimpleNamespace(remote=note_rollback))
    monkeypatch.setattr(dd.serve, "get_deployment_handle", lambda name, app: handles.append((name, app)) or handle)
    backend = dd.DisaggBackend(cfg)  # never set up: its set-up may be what fails
    assert asyncio.run(asyncio.wait_for(backend.admin_rollback("sql", None), 10)) == {"expert": "sql", "serving_version": 1}
    assert VersionStore(tmp_path / "app1" / "sql").current == 1 and handles == [("Verifier", "app1")]
    assert told == ([("sql", 1)] if verifier == "told" else [])
    assert ("the Verifier was not told" in caplog.text) == (verifier != "told")

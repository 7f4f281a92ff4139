"""End to end on a local Ray cluster, started the way users start it: `serve run` on a variant of
serve_config.yaml (tiny models built here, small replicas, fast triggers). One cluster per session."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

from tests.conftest import char_tokenizer, llama, perturbed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY, ADMIN = "sk-e2e", "admin-e2e"
PROMPTS = ["def f(x):", "x = [1, 2", "print('hi')", "import os", "class A:", "for i in r"]


def _free_port() -> int:
    """A free port below the kernel's ephemeral range (and above Ray's worker ports, 10002-19999). A port
    the kernel handed out here was free when checked, but Ray, starting up, binds ephemeral ports of its
    own: once one of its processes took it first and Serve's proxy failed to bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, min(low, 32768)))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    tok = char_tokenizer()
    target = llama(len(tok), seed=3)
    # Room for a long generation (rotary positions, so the weights are unchanged): the disconnect test's
    # sequence must still be running when its client's hang-up reaches the replica.
    target.config.max_position_embeddings = 8192
    for name, m in (("target", target), ("draft", perturbed(target, 0.08))):
        m.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = _free_port()
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    app = cfg["applications"][0]
    app["args"].update(target=str(tmp / "target"), draft=str(tmp / "draft"), api_key=KEY, admin_key=ADMIN,
                       num_speculative_tokens=3, max_model_len=8192)
    app["args"]["distill"].update(trigger_records=4, trigger_age_s=2, versions_dir=str(tmp / "versions"), mode="full", lr=3e-3)
    # Rows reach W&B when GET /admin/metrics closes a window (the distillation test measures α per round).
    app["args"]["wandb"] = {"mode": "offline", "dir": str(tmp / "wandb"), "log_every_s": 3600}
    for d in app["deployments"]:  # a 2-core CI machine: one small replica each
        d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1}
        d["ray_actor_options"] = {"num_cpus": 0.5}
    # The disaggregated topology as a second application in the same cluster, under /disagg.
    dis = yaml.safe_load((ROOT / "serve_config.disaggregated.yaml").read_text())["applications"][0]
    dis["args"].update(target=str(tmp / "target"), draft=str(tmp / "draft"), api_key=KEY, admin_key=ADMIN,
                       num_speculative_tokens=3, max_model_len=8192, wandb=app["args"]["wandb"],
                       draft_ahead=True)  # auto is off on CPU
    # Distillation through the cluster: buffer actor, controller, a Ray Train job, hot-swap in DraftPool.
    dis["args"]["distill"].update(trigger_records=4, trigger_age_s=2, versions_dir=str(tmp / "versions-disagg"),
                                  mode="full", lr=3e-3)
    dis.update(name="disagg", route_prefix="/disagg")
    for d in dis["deployments"]:  # small logical shares: half a CPU stays free for one Ray Train worker
        d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1}
        d["ray_actor_options"] = {"num_cpus": 0.1}
    cfg["applications"].append(dis)
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # A busy 2-core machine answers health checks slowly: the proxy must not be killed for it.
    env = os.environ | {"RAY_DEDUP_LOGS": "0", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1",
                        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
    serve_cli = Path(sys.executable).with_name("serve")  # the console script of this environment's ray
    proc = subprocess.Popen([str(serve_cli) if serve_cli.exists() else "serve", "run", str(path)], cwd=tmp, env=env,
                            stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/disagg/health", timeout=2).status_code == 200:
                ok = [httpx.post(f"{base}{prefix}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"prompt": "x", "max_tokens": 1}, timeout=30).status_code == 200
                      for prefix in ("", "/disagg")]
                if all(ok):
                    break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail("serve run exited:\n" + (tmp / "serve.log").read_text()[-3000:])
        time.sleep(2)
    else:
        proc.terminate()
        pytest.fail("server did not come up:\n" + (tmp / "serve.log").read_text()[-3000:])
    yield base, target, tok, tmp
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    subprocess.run(["ray", "stop", "--force"], capture_output=True)


@torch.inference_mode()
def _greedy(target, tok, prompt, n):
    ids = torch.tensor([tok.encode(prompt)])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("prefix", ["", "/disagg"], ids=["colocated", "disaggregated"])
def test_concurrent_openai_requests_equal_target_greedy(server, prefix):
    base, target, tok, _ = server
    client = openai.OpenAI(base_url=f"{base}{prefix}/v1", api_key=KEY)

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            return p, client.completions.create(model="osd-serve", prompt=p, max_tokens=12, temperature=0).choices[0].text
        stream = client.completions.create(model="osd-serve", prompt=p, max_tokens=12, temperature=0, stream=True)
        return p, "".join(c.choices[0].text for c in stream)

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(12)))
    for p, text in got:
        assert text == _greedy(target, tok, p, 12), p
    chat = client.chat.completions.create(model="osd-serve", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    assert chat.choices[0].message.content == _greedy(target, tok, "user: hi\nassistant:", 5)


@pytest.mark.parametrize("prefix", ["", "/disagg"], ids=["colocated", "disaggregated"])
def test_bad_requests_get_400_and_401_and_the_service_stays_up(server, prefix):
    base, *_ = server
    base += prefix
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "x"}).status_code == 401
    for body, param in [({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x" * 9000}, "prompt"),
                        ({"prompt": "x", "temperature": "warm"}, "temperature"), ({"prompt": "x", "bogus": 1}, "bogus")]:
        r = httpx.post(f"{base}/v1/completions", headers=h, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{base}/v1/completions", headers=h, content=b"{", timeout=30).status_code == 400
    # logprobs cross Ray from the engine replica (disaggregated: from the Verifier, in its Verdicts)
    r = httpx.post(f"{base}/v1/completions", headers=h, json={"prompt": "x", "max_tokens": 3, "logprobs": 1, "ignore_eos": True},
                   timeout=30)  # sampled: without ignore_eos an EOS drawn early ends it short of 3 (CI saw 2)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(f"{base}/v1/completions", headers=h, json={"prompt": "x", "max_tokens": 2}, timeout=30)
    # one x-request-id, Serve's: the app once added its own beside it, and the openai SDK read both as one id
    assert r.status_code == 200 and len(r.headers.get_list("x-request-id")) == 1 and r.headers["x-osd-expert"], r.headers
    # readiness by the Serve controller's replica count (deployments.app.require_running), no key needed
    r = httpx.get(f"{base}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


def _metrics(base) -> list[dict]:
    return httpx.get(f"{base}/admin/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()["history"]


def _experts(base):
    return httpx.get(f"{base}/admin/experts", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()["experts"]


@pytest.mark.parametrize("prefix", ["", "/disagg"], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_disconnect_frees_its_sequence(server, prefix, stream):
    """The sequence is aborted, not run out: a row left to decode also leaves the batch, once it reaches
    max_tokens, so "running" going to 0 alone would pass without the abort. So the run must outlast the
    hang-up's way to the replica by far, on a busy 2-core machine too: in one CI run a 1,500-token stream
    at k = 3 with a distilled draft was done before it arrived. 8,000 tokens at k = 0 (one target forward
    each) take this model about 10 s on one idle core; a test that fails still ends at its 30 s wait."""
    base, *_ = server
    base += prefix
    before = _experts(base)["default"]["finished"]
    body = {"prompt": "def g(", "max_tokens": 8000, "temperature": 0, "stream": stream, "ignore_eos": True,
            "expert": "default", "num_speculative_tokens": 0}
    if stream:
        with httpx.stream("POST", f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json=body) as r:
            assert r.status_code == 200, r.read()
            next(r.iter_lines())
    else:  # the client hangs up while its whole completion is being generated
        raw = json.dumps(body).encode()
        host, port = base.removeprefix("http://").split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(f"POST {prefix}/v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
            for _ in range(500):  # admission on a busy machine; the run itself takes ~10 s
                if _experts(base)["default"]["running"]:
                    break
                time.sleep(0.02)
            else:
                pytest.fail("the sequence was never seen running")
    for _ in range(60):
        info = _experts(base)["default"]
        if info["running"] == 0 and info["finished"]["abort"] > before["abort"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the abandoned sequence was not aborted: {info}")
    assert info["finished"]["abort"] == before["abort"] + 1 and info["finished"]["length"] == before["length"], info


@pytest.mark.parametrize("prefix", ["", "/disagg"], ids=["colocated", "disaggregated"])
def test_distiller_publishes_and_alpha_rises_and_wandb_holds_it(server, prefix):
    """Colocated: each replica distils beside its engine (backend local). Disaggregated: the verifier
    records into the cluster's buffer, a Ray Train job trains, DraftPool hot-swaps (backend ray_train)."""
    base, _, _, tmp = server
    base += prefix
    # An expert no other test sends traffic to, so its first round is served by the initial draft.
    expert = "sql"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)

    def round_alpha() -> float:
        """Send the same traffic once; α over it (GET /admin/metrics closes the telemetry window)."""
        _metrics(base)
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            list(ex.map(lambda p: client.completions.create(model="osd-serve", prompt=p, max_tokens=16, temperature=0,
                                                            extra_body={"expert": expert}), PROMPTS))
        return _metrics(base)[-1][f"alpha/{expert}"]

    t_start = time.time()
    first, deadline, after = round_alpha(), t_start + 420, []
    while len(after) < 2:  # again and again, until a new draft version has served two whole rounds
        served = bool(_experts(base)[expert]["serving_version"])
        alpha = round_alpha()
        if served:
            after.append(alpha)
        assert time.time() < deadline, f"no new draft version within {deadline - t_start:.0f}s: {_experts(base)}"
    info = _experts(base)[expert]
    assert len(info["versions"]) > 1, info
    assert min(after) > first, (first, after)
    # The W&B offline run of this topology's telemetry (SpecServer replicas / the Verifier) holds it.
    run_name = b"osd-verifier" if prefix else b"osd-serve-"
    deadline = time.time() + 60  # W&B's writer flushes on its own schedule
    while time.time() < deadline:
        files = [f.read_bytes() for f in (tmp / "wandb").rglob("*.wandb")]
        if any(run_name in b and f"alpha/{expert}".encode() in b for b in files):
            break
        time.sleep(2)
    assert any(run_name in b and f"alpha/{expert}".encode() in b for b in files)


def test_a_killed_replica_comes_back_with_its_records(server):
    """Colocated (distill.backend local): the replay buffer lived in the replica's process, and the replica
    Serve started in place of a crashed one began empty. It takes the freed versions slot over, records too."""
    base, _, _, tmp = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    for p in PROMPTS:  # an expert the other tests leave alone; every 4th request is a guard sample, always recorded
        client.completions.create(model="osd-serve", prompt=p, max_tokens=8, temperature=0, extra_body={"expert": "code"})
    answer = httpx.get(f"{base}/admin/experts", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    held, replica = answer["experts"]["code"]["buffer_records"], answer["replica"]
    def on_disk() -> int:  # in the replica's slot (slot-0, unless Serve had replaced it before)
        return max((len(list(d.glob("*.safetensors"))) for d in (tmp / "versions" / "osd" / "replicas").glob(
            "slot-*/.replay/code")), default=0)

    for _ in range(100):  # written in the background: what a kill -9 finds on disk
        if on_disk() == held:
            break
        time.sleep(0.1)
    assert held >= 2 and on_disk() == held
    pids = subprocess.run(["pgrep", "-f", "ServeReplica:osd:SpecServer"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids
    os.kill(int(pids[0]), 9)
    deadline, seen = time.time() + 180, None
    while time.time() < deadline:
        try:
            seen = httpx.get(f"{base}/admin/experts", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
            if seen.get("replica") not in (None, replica):
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    assert seen and seen.get("replica") not in (None, replica), seen
    assert seen["experts"]["code"]["buffer_records"] == held, seen["experts"]["code"]

"""End to end on a local Ray cluster, started the way users start it: `serve run` on a variant of
serve_config.yaml (tiny models built here, small replicas, fast triggers). One cluster per session."""

from __future__ import annotations

import concurrent.futures
import os
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    tok = char_tokenizer()
    target = llama(len(tok), seed=3)
    for name, m in (("target", target), ("draft", perturbed(target, 0.08))):
        m.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = _free_port()
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    app = cfg["applications"][0]
    app["args"].update(target=str(tmp / "target"), draft=str(tmp / "draft"), api_key=KEY, admin_key=ADMIN,
                       num_speculative_tokens=3)
    app["args"]["distill"].update(trigger_records=4, trigger_age_s=2, versions_dir=str(tmp / "versions"), mode="full", lr=3e-3)
    app["args"]["wandb"] = {"mode": "offline", "dir": str(tmp / "wandb"), "log_every_s": 0.5}
    for d in app["deployments"]:  # a 2-core CI machine: one small replica each
        d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1}
        d["ray_actor_options"] = {"num_cpus": 0.5}
    # The disaggregated topology as a second application in the same cluster, under /disagg.
    dis = yaml.safe_load((ROOT / "serve_config.disaggregated.yaml").read_text())["applications"][0]
    dis["args"].update(target=str(tmp / "target"), draft=str(tmp / "draft"), api_key=KEY, admin_key=ADMIN,
                       num_speculative_tokens=3, wandb=app["args"]["wandb"])
    dis.update(name="disagg", route_prefix="/disagg")
    for d in dis["deployments"]:
        d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1}
        d["ray_actor_options"] = {"num_cpus": 0.25}
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
    for body, param in [({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x" * 5000}, "prompt"),
                        ({"prompt": "x", "temperature": "warm"}, "temperature"), ({"prompt": "x", "bogus": 1}, "bogus")]:
        r = httpx.post(f"{base}/v1/completions", headers=h, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{base}/v1/completions", headers=h, content=b"{", timeout=30).status_code == 400
    assert httpx.post(f"{base}/v1/completions", headers=h, json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200


def _experts(base):
    return httpx.get(f"{base}/admin/experts", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()["experts"]


@pytest.mark.parametrize("prefix", ["", "/disagg"], ids=["colocated", "disaggregated"])
def test_a_client_disconnect_frees_its_sequence(server, prefix):
    base, *_ = server
    base += prefix
    with httpx.stream("POST", f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"prompt": "def g(", "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True,
                            "expert": "default"}) as r:
        next(r.iter_lines())
    for _ in range(60):
        if _experts(base)["default"]["running"] == 0:
            return
        time.sleep(0.5)
    pytest.fail("the aborted sequence is still running")


def test_distiller_publishes_and_alpha_rises_and_wandb_holds_it(server):
    base, _, _, tmp = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    adm = {"Authorization": f"Bearer {ADMIN}"}
    t_start = time.time()
    for _ in range(6):  # the same traffic, again and again
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            list(ex.map(lambda p: client.completions.create(model="osd-serve", prompt=p, max_tokens=16, temperature=0,
                                                            extra_body={"expert": "default"}), PROMPTS))
    info = _experts(base)["default"]
    assert info["serving_version"] > 0 and len(info["versions"]) > 1, info
    hist = httpx.get(f"{base}/admin/metrics", headers=adm, timeout=30).json()["history"]
    alpha = [h["alpha/default"] for h in hist if "alpha/default" in h and h["time"] >= t_start]
    assert len(alpha) >= 4
    k = max(1, len(alpha) // 4)
    assert sum(alpha[-k:]) / k > sum(alpha[:k]) / k, alpha
    files = list((tmp / "wandb").rglob("*.wandb"))
    assert files
    deadline = time.time() + 60  # W&B's writer flushes on its own schedule
    while time.time() < deadline and not any(b"alpha/default" in f.read_bytes() for f in files):
        time.sleep(2)
    assert any(b"alpha/default" in f.read_bytes() for f in files)

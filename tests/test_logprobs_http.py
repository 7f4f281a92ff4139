"""logprobs over HTTP (in-process SpecService): OpenAI's two shapes, whole and streamed, and through the
openai SDK's own types. The values are the target's (test_logprobs.py checks the engine's)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from fastapi.testclient import TestClient

from deployments.api import make_app
from deployments.config import AppConfig
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed

AUTH = {"Authorization": "Bearer sk-test"}


@pytest.fixture(scope="module")
def served(tok, tmp_path_factory):
    target, tmp = llama(len(tok), seed=3), tmp_path_factory.mktemp("lp")
    cfg = AppConfig(num_speculative_tokens=3, distill={"enabled": False, "versions_dir": str(tmp / "v")},
                    wandb={"mode": "disabled"}, api_key="sk-test")
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    yield make_app(svc, cfg), target
    svc.close()


def _events(client, path, body) -> list[dict]:
    with client.stream("POST", path, headers=AUTH, json=body | {"stream": True}) as s:
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@torch.inference_mode()
def _target_logprobs(target, tok, prompt: str, out_ids: list[int]) -> list[float]:
    p = tok.encode(prompt)
    lp = target(torch.tensor([p + out_ids])).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
    return lp.gather(1, torch.tensor(out_ids)[:, None])[:, 0].tolist()


def test_completions_logprobs_whole_and_streamed(served, tok):
    app, target = served
    client = TestClient(app)
    body = {"prompt": "def f(x):", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    r = client.post("/v1/completions", headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["completion_tokens"] == 10
    assert "".join(lp["tokens"]) == choice["text"]  # one character a token, no stop: the text itself
    assert lp["text_offset"] == list(range(10))
    ids = tok.convert_tokens_to_ids(lp["tokens"])
    assert lp["token_logprobs"] == pytest.approx(_target_logprobs(target, tok, body["prompt"], ids), abs=2e-4)
    for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # greedy: the chosen token is the likeliest, so the two likeliest hold it
        assert len(top) == 2 and top[t] == v and max(top.values()) == v
    chunks = _events(client, "/v1/completions", body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]  # offsets run on across chunks
    assert sum((p["token_logprobs"] for p in parts), []) == pytest.approx(lp["token_logprobs"], abs=1e-5)
    plain = client.post("/v1/completions", headers=AUTH, json=body | {"logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == choice["text"]


def test_a_stop_strings_tokens_keep_their_logprobs(served):
    """The token completing a stop string is counted in usage and has its logprob; its text is cut."""
    app, _ = served
    client = TestClient(app)
    body = {"prompt": "def f(x):", "max_tokens": 10, "temperature": 0, "logprobs": 0}
    text = client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
    stopped = client.post("/v1/completions", headers=AUTH, json=body | {"stop": [text[3:5]]}).json()
    lp, n = stopped["choices"][0]["logprobs"], stopped["usage"]["completion_tokens"]
    assert stopped["choices"][0]["finish_reason"] == "stop" and n < 10
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == n and "".join(lp["tokens"]).startswith(stopped["choices"][0]["text"])
    assert all(len(top) == 1 for top in lp["top_logprobs"])  # 0 alternatives: the chosen token's own


def test_chat_logprobs_through_the_openai_sdk(served):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    app, _ = served
    msgs = [{"role": "user", "content": "hi"}]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as hc:
            c = openai.AsyncOpenAI(base_url="http://t/v1", api_key="sk-test", http_client=hc, max_retries=0)
            whole = await c.chat.completions.create(model="osd-serve", messages=msgs, max_tokens=6, temperature=0,
                                                    logprobs=True, top_logprobs=3)
            stream = await c.chat.completions.create(model="osd-serve", messages=msgs, max_tokens=6, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True)
            return whole, [ch async for ch in stream]

    whole, chunks = asyncio.run(go())
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content and len(content) == 6
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob  # greedy: the likeliest
        assert t.bytes == list(t.token.encode()) and t.top_logprobs[0].logprob >= t.top_logprobs[2].logprob
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]

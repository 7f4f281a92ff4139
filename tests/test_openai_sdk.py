"""The HTTP API through the official openai SDK (in-process, httpx's ASGI transport): its types, its errors."""

import asyncio

import pytest

from deployments.api import make_app
from deployments.config import AppConfig
from osd_serve.service import SpecService
from tests.conftest import llama, perturbed

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def app(tok, tmp_path_factory):
    target, tmp = llama(len(tok), seed=3), tmp_path_factory.mktemp("sdk")
    cfg = AppConfig(experts=[{"name": "default"}, {"name": "sql", "keywords": ["select"]}], num_speculative_tokens=3,
                    distill={"versions_dir": str(tmp / "v")}, wandb={"mode": "disabled"}, api_key="sk-test")
    svc = SpecService(cfg, models=(target, perturbed(target, 0.05), tok))
    yield make_app(svc, cfg)
    svc.close()


def _run(app, body, key="sk-test"):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as hc:
            return await body(openai.AsyncOpenAI(base_url="http://t/v1", api_key=key, http_client=hc, max_retries=0))
    return asyncio.run(go())


def test_openai_sdk_main_paths(app):
    async def body(c):
        r = await c.completions.with_raw_response.create(model="osd-serve", prompt="select 1", max_tokens=6, temperature=0)
        done = r.parse()
        assert r.headers["x-osd-expert"] == "sql" and done.object == "text_completion" and done.id.startswith("cmpl-")
        assert done.usage.completion_tokens == len(r.http_response.json()["choices"][0]["text"]) == 6  # a char a token
        assert done.choices[0].finish_reason == "length" and isinstance(done.created, int)
        chat = await c.chat.completions.create(model="osd-serve", messages=[{"role": "user", "content": "hi"}],
                                               max_completion_tokens=5, temperature=0, extra_body={"expert": "sql"})
        msg = chat.choices[0].message
        assert chat.object == "chat.completion" and msg.role == "assistant" and isinstance(msg.content, str)
        stream = await c.chat.completions.create(model="osd-serve", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"expert": "sql"})
        chunks = [ch async for ch in stream]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content
        assert chunks[-1].choices == [] and chunks[-1].usage == chat.usage
        assert chunks[-2].choices[0].finish_reason == chat.choices[0].finish_reason
        assert [m.id for m in (await c.models.list()).data] == ["osd-serve"]
        # newer fields the SDK types, at values that ask for nothing, were a 400 "Extra inputs are not permitted"
        newer = await c.chat.completions.create(model="osd-serve", messages=[{"role": "user", "content": "x"}], max_tokens=2, store=False,
                                                metadata=None, service_tier="auto", parallel_tool_calls=False, reasoning_effort=None,
                                                modalities=["text"], safety_identifier="u-1", prompt_cache_key="k", stream=True,
                                                stream_options={"include_usage": True, "include_obfuscation": False},
                                                extra_body={"ignore_eos": True})  # sampled: an EOS drawn would end it early
        assert [ch async for ch in newer][-1].usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError) as e:  # one that asks for something is still refused, by name
            await c.chat.completions.create(model="osd-serve", messages=[{"role": "user", "content": "x"}], store=True)
        assert e.value.param == "store"
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="osd-serve", messages=[{"role": "user", "content": "x"}], temperature=3)
        assert e.value.param == "temperature" and e.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError) as e:
            await c.completions.create(model="gpt-4o", prompt="x")
        assert e.value.code == "model_not_found"
    _run(app, body)
    with pytest.raises(openai.AuthenticationError) as e:
        _run(app, lambda c: c.models.list(), key="wrong")
    assert e.value.code == "invalid_api_key"  # OpenAI's code for it; was None

"""OpenAI's official Python SDK against the gateway, as its users write it: only `base_url` changes.

Run by crates/sbp-cli/tests/binary/openai_sdks.rs with the gateway's URL (its upstream is the
fake LLM) as the first argument; prints `ok <scenario>` for each scenario that held and exits
non-zero (with the traceback) at the first that did not.
"""

import json
import sys
import urllib.request

import openai

BASE = sys.argv[1].rstrip("/")
MODEL = "gpt-4o-mini"


def client(**kwargs):
    kwargs.setdefault("api_key", "sk-not-used-by-the-gateway")
    return openai.OpenAI(base_url=BASE + "/v1", **kwargs)


def counting_client(counter, **kwargs):
    """A client whose HTTP requests (retries included) are counted in `counter`."""

    def hook(_request):
        counter.append(1)

    http = openai.DefaultHttpxClient(event_hooks={"request": [hook]})
    return client(http_client=http, **kwargs)


def user(text):
    return [{"role": "user", "content": text}]


def sbp(completion):
    """The gateway's `sbp` block, which the SDK keeps as an extra field."""
    return (completion.model_extra or {}).get("sbp") or {}


def new_session():
    raw = client().chat.completions.with_raw_response.create(model=MODEL, messages=user("hello"))
    completion = raw.parse()
    token = raw.headers["x-session-token"]
    assert token.startswith("sbp_"), token
    return completion, token


def suspend(session_id, token):
    req = urllib.request.Request(
        f"{BASE}/v1/sbp/sessions/{session_id}/status",
        data=json.dumps({"status": "suspended"}).encode(),
        headers={"content-type": "application/json", "x-session-token": token},
        method="PATCH",
    )
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200, resp.status


def create():
    completion, _ = new_session()
    assert completion.choices[0].message.content == "echo: hello", completion
    assert completion.usage is not None and completion.usage.total_tokens > 0
    assert sbp(completion)["step_count"] == 1


def stream_loop():
    # The loop of OpenAI's own docs: every chunk has choices[0].
    text = ""
    for chunk in client().chat.completions.create(
        model=MODEL, messages=user("[[fake:chunks=3]] one two three"), stream=True
    ):
        text += chunk.choices[0].delta.content or ""
    assert text == "echo: one two three", text


def stream_usage():
    with client().chat.completions.stream(
        model=MODEL,
        messages=user("[[fake:chunks=2]] count me"),
        stream_options={"include_usage": True},
    ) as stream:
        for _event in stream:
            pass
        final = stream.get_final_completion()
    assert final.usage is not None and final.usage.total_tokens > 0, final
    assert final.choices[0].message.content == "echo: count me", final
    chunks = list(
        client().chat.completions.create(
            model=MODEL, messages=user("last"), stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    assert all(c.choices for c in chunks[:-1])


def session_token_as_api_key():
    first, token = new_session()
    sid = sbp(first)["session_id"]
    again = client(api_key=token).chat.completions.create(model=MODEL, messages=user("me again"))
    assert sbp(again)["session_id"] == sid, sbp(again)
    assert sbp(again)["step_count"] == 2, sbp(again)


def suspended_session():
    first, token = new_session()
    sid = sbp(first)["session_id"]
    suspend(sid, token)
    sent = []
    try:
        counting_client(sent, api_key=token, max_retries=2).chat.completions.create(
            model=MODEL, messages=user("are you there?")
        )
        raise AssertionError("a suspended session answered")
    except openai.APIStatusError as e:
        assert e.status_code == 423, e
        assert e.code == "SBP_SESSION_SUSPENDED", e.body
        assert "X-SBP-Auto-Resume" in str(e), e
    assert len(sent) == 1, f"retried: {len(sent)} requests"
    try:
        stream = client(api_key=token).chat.completions.create(
            model=MODEL, messages=user("stream?"), stream=True
        )
        list(stream)
        raise AssertionError("a suspended session streamed")
    except openai.APIStatusError as e:
        assert e.status_code == 423, e
    resumed = client(api_key=token, default_headers={"X-SBP-Auto-Resume": "true"})
    back = resumed.chat.completions.create(model=MODEL, messages=user("back"))
    assert back.choices[0].message.content == "echo: back", back
    assert sbp(back)["session_id"] == sid


def upstream_error():
    try:
        client().chat.completions.create(model="fake-error-404", messages=user("hi"))
        raise AssertionError("no error")
    except openai.NotFoundError as e:
        assert e.code == "SBP_UPSTREAM_ERROR", e.body
        assert e.type == "invalid_request_error", e.body
        assert e.param == "model", e.body
        assert e.body["upstream_code"] == "model_not_found", e.body
        assert e.body["message"] == "fake error", e.body


def refused_requests():
    for messages, param in [
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 12}], "messages[0].content"),
        ([{"role": "tool", "content": "r"}], "messages[0].tool_call_id"),
    ]:
        try:
            client().chat.completions.create(model=MODEL, messages=messages)
            raise AssertionError(f"accepted {messages}")
        except openai.BadRequestError as e:
            assert e.param == param, e.body
    try:
        client().chat.completions.create(model=MODEL, messages=user("two"), n=2)
        raise AssertionError("n=2 accepted")
    except openai.BadRequestError as e:
        assert e.param == "n", e.body


def session_count():
    with urllib.request.urlopen(f"{BASE}/v1/sessions?limit=100") as resp:
        return len(json.load(resp)["data"])


def no_orphan_sessions():
    # The SDK retries a 503 twice: three requests, and no session left behind by any of them.
    before = session_count()
    sent = []
    try:
        counting_client(sent, max_retries=2).chat.completions.create(
            model="fake-error-503", messages=user("hi")
        )
        raise AssertionError("no error")
    except openai.InternalServerError:
        pass
    assert len(sent) == 3, f"{len(sent)} requests"
    assert session_count() == before, (session_count(), before)


def models():
    ids = [m.id for m in client().models.list()]
    assert "fake" in ids, ids
    assert client().models.retrieve("fake").id == "fake"
    try:
        client().models.retrieve("no-such-model")
        raise AssertionError("found")
    except openai.NotFoundError:
        pass


SCENARIOS = [
    create,
    stream_loop,
    stream_usage,
    session_token_as_api_key,
    suspended_session,
    upstream_error,
    refused_requests,
    no_orphan_sessions,
    models,
]

if __name__ == "__main__":
    wanted = sys.argv[2:]
    for scenario in SCENARIOS:
        if wanted and scenario.__name__ not in wanted:
            continue
        scenario()
        print("ok", scenario.__name__, flush=True)

"""Drives LlamaCppEx.HTTPServer with the official `openai` client (test/http_server_test.exs
runs it): python3 test/openai_client.py BASE_URL API_KEY

Every check asserts; the script prints one line per check and exits non-zero on the first
failure."""

import base64
import concurrent.futures
import json
import struct
import sys
import urllib.request

import openai

BASE, KEY = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)
MSG = [{"role": "user", "content": "What is the capital of France?"}]


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name} {detail}")
        sys.exit(1)
    print(f"ok   {name}")


# chat, blocking
r = client.chat.completions.create(model="local", messages=MSG, max_tokens=16, temperature=0)
check("chat", r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length"))
check("chat usage", r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0)
want = r.choices[0].message.content
r0_tokens = r.usage.completion_tokens

# chat, streamed with usage: same text as blocking (greedy)
parts, usage, finish = [], None, None
for chunk in client.chat.completions.create(model="local", messages=MSG, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
check("chat stream text", "".join(parts) == want, repr(("".join(parts), want)))
check("chat stream usage", usage is not None and usage.completion_tokens == r.usage.completion_tokens)
check("chat stream finish", finish in ("stop", "length"))

# n choices
r = client.chat.completions.create(model="local", messages=MSG, max_tokens=8, temperature=0.9,
                                   seed=1, n=3)
check("n choices", [c.index for c in r.choices] == [0, 1, 2])

# n choices, streamed: chunks interleave, each with its index; greedy, all equal the one
texts, finishes, usage = {}, {}, None
for chunk in client.chat.completions.create(model="local", messages=MSG, max_tokens=16,
                                            temperature=0, n=3, stream=True,
                                            stream_options={"include_usage": True}):
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        if c.finish_reason:
            finishes[c.index] = c.finish_reason
check("n streamed", sorted(texts) == [0, 1, 2] and all(t == want for t in texts.values())
      and len(finishes) == 3, texts)
check("n streamed usage", usage.completion_tokens == 3 * r0_tokens, usage)

# logprobs
r = client.chat.completions.create(model="local", messages=MSG, max_tokens=4, temperature=0,
                                   logprobs=True, top_logprobs=3)
lp = r.choices[0].logprobs.content
check("chat logprobs", len(lp) >= 1 and len(lp[0].top_logprobs) == 3 and lp[0].logprob <= 0)

# JSON schema
schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"]}
r = client.chat.completions.create(
    model="local", messages=MSG, max_tokens=40, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
check("json schema", "city" in json.loads(r.choices[0].message.content))

# tools, blocking and streamed
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}]
r = client.chat.completions.create(model="local", messages=MSG, max_tokens=60, temperature=0,
                                   tools=tools, tool_choice="required", parallel_tool_calls=False)
calls = r.choices[0].message.tool_calls
check("tools", r.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
      and "city" in json.loads(calls[0].function.arguments))
acc = {}
for chunk in client.chat.completions.create(model="local", messages=MSG, max_tokens=60,
                                            temperature=0, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, stream=True):
    for c in chunk.choices:
        for d in c.delta.tool_calls or []:
            e = acc.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            if d.id:
                e["id"] = d.id
            if d.function and d.function.name:
                e["name"] += d.function.name
            if d.function and d.function.arguments:
                e["arguments"] += d.function.arguments
check("tools streamed", acc[0]["name"] == "get_weather" and acc[0]["id"]
      and json.loads(acc[0]["arguments"]) == json.loads(calls[0].function.arguments))

# completions
r = client.completions.create(model="local", prompt="The capital of France is", max_tokens=8,
                              temperature=0, logprobs=2, echo=True)
check("completions echo", r.choices[0].text.startswith("The capital of France is"))
check("completions logprobs", len(r.choices[0].logprobs.top_logprobs[0]) == 2)
text = "".join(c.choices[0].text for c in client.completions.create(
    model="local", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
check("completions stream", r.choices[0].text == "The capital of France is" + text)

# embeddings
e = client.embeddings.create(model="local", input=["hello", "world"])
v = e.data[0].embedding
check("embeddings", len(e.data) == 2 and abs(sum(x * x for x in v) - 1.0) < 1e-3)
# (the client asks for base64 by default and decodes it; asked explicitly, it hands it over)
b = client.embeddings.create(model="local", input="hello", encoding_format="base64")
raw = base64.b64decode(b.data[0].embedding)
floats = struct.unpack(f"<{len(raw) // 4}f", raw)
check("embeddings base64", len(floats) == len(v) and abs(floats[0] - v[0]) < 1e-6)

# errors in OpenAI's shape
try:
    client.chat.completions.create(model="local", messages="nope")
    check("400", False)
except openai.BadRequestError as err:
    check("400", err.body["message"].startswith("messages must be"), err.body)
try:
    openai.OpenAI(base_url=BASE + "/v1", api_key="wrong", max_retries=0).models.list()
    check("401", False)
except openai.AuthenticationError:
    check("401", True)
try:
    client.embeddings.create(model="local", input="x", dimensions=8)
    check("dimensions", False)
except openai.BadRequestError as err:
    check("dimensions", "dimensions" in err.body["message"])
check("models", client.models.list().data[0].id == "local")

# disconnect mid-stream: the server keeps serving others
s = client.chat.completions.create(model="local", messages=MSG, max_tokens=200, stream=True)
next(iter(s))
s.response.close()
r = client.chat.completions.create(model="local", messages=MSG, max_tokens=4, temperature=0)
check("after a disconnect", r.choices[0].message.content is not None)

# 8 concurrent clients get the greedy text of one alone
def one(_):
    return client.chat.completions.create(model="local", messages=MSG, max_tokens=16,
                                          temperature=0).choices[0].message.content
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    outs = list(pool.map(one, range(8)))
check("8 concurrent", all(o == want for o in outs), outs)
print("openai_client: all checks passed")

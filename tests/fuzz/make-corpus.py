#!/usr/bin/env python3
"""make-corpus.py - writes the seed corpora of tests/fuzz (docs/fuzzing.md).

    tests/fuzz/make-corpus.py --fuzz-build build-fuzz --bin build/bin [codec tokenizer gguf manifest jinja]

- corpus/codec: every message type, from make_codec_seeds (built in the fuzz build directory).
- corpus/tokenizer: small tokenizer.json files: a cut of the Llama 3 tokenizer
  (tests/data/llama3-tokenizer: the ids below 480 and the merges among them, 8 added tokens
  renumbered after them), a GPT-2-style variant of it, the SentencePiece-style fixtures of
  tests/unit/tokenizer/data, and a few near-valid files.
- corpus/manifest: checkpoint directories in fuzz_manifest's text form ("@@@@ NAME [OPTION]"
  sections): config.json, generation_config.json, safetensors headers and the index of the tiny
  synthetic checkpoints that make-synthetic-model writes (bf16, f32 sharded and tied, f16
  Mistral), one with the small tokenizer.json, near-valid ones, and a directory holding a GGUF
  header.
- corpus/gguf: GGUF headers from make_gguf_seeds (built in the fuzz build directory): the tiny
  Llama in several types, with tokenizers, with llama3 RoPE scaling, and refused ones; and the
  headers of make-synthetic-model's Qwen3 and mixture-of-experts GGUF files (qwen3, qwen3moe,
  llama with experts and a sliding window, experts fused in ffn_*_exps tensors).
- corpus/jinja: the chat templates of tests/unit/jinja/templates and the one-feature templates of
  its cases.json, their variables after a NUL byte.

Files of the corpora are named by content (what libFuzzer itself does), except the hand-named
regression inputs (regress-*), which this script leaves alone.
"""
import argparse
import copy
import glob
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")


def clear(target):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        if not f.startswith("regress-"):
            os.unlink(os.path.join(d, f))
    return d


def put(d, data, name=None):
    if isinstance(data, str):
        data = data.encode()
    name = name or hashlib.sha1(data).hexdigest()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def codec(fuzz_build):
    d = clear("codec")
    tmp = tempfile.mkdtemp()
    try:
        subprocess.run([os.path.join(fuzz_build, "fuzz", "make_codec_seeds"), tmp], check=True)
        for f in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, f), "rb") as fh:
                put(d, fh.read(), "seed-" + f)
    finally:
        shutil.rmtree(tmp)


def gguf_header(data):
    """The bytes of a GGUF file before its tensor data (fuzz_gguf extends a header to its data)."""
    pos = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16
    align = 32

    def string(p):
        (n,) = struct.unpack_from("<Q", data, p)
        return data[p + 8:p + 8 + n], p + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(t, p):
        if t == 8:
            return string(p)
        if t == 9:
            et, n = struct.unpack_from("<IQ", data, p)
            p += 12
            for _ in range(n):
                _, p = value(et, p)
            return None, p
        return data[p:p + sizes[t]], p + sizes[t]

    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", data, pos)
        v, pos = value(t, pos + 4)
        if key == b"general.alignment":
            (align,) = struct.unpack("<I", v)
    for _ in range(n_tensors):
        _, pos = string(pos)
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * nd + 4 + 8
    return data[:(pos + align - 1) // align * align]


# make-synthetic-model's GGUF forms beyond the tiny Llama: (seed name, its arguments).
SYNTHETIC_GGUF = [
    ("qwen3-f32", ["--shape", "qwen3-tiny", "--type", "f32"]),
    ("qwen3-moe-f32", ["--shape", "qwen3-moe-tiny", "--type", "f32"]),
    ("qwen3-moe-nonorm-bf16", ["--shape", "qwen3-moe-tiny", "--no-norm-topk", "--layers", "1"]),
    ("mixtral-window-q8_0", ["--shape", "mixtral-tiny", "--sliding-window", "48", "--layers", "2", "--type",
                             "q8_0"]),
]


def gguf(fuzz_build, bin_dir):
    d = clear("gguf")
    tmp = tempfile.mkdtemp()
    try:
        subprocess.run([os.path.join(fuzz_build, "fuzz", "make_gguf_seeds"), ROOT, tmp], check=True)
        for f in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, f), "rb") as fh:
                put(d, fh.read(), f)
        for name, args in SYNTHETIC_GGUF:
            out = os.path.join(tmp, name)
            subprocess.run([os.path.join(bin_dir, "make-synthetic-model"), *args, "--format", "gguf", "--out", out,
                            "--quiet"], check=True, stdout=subprocess.DEVNULL)
            (path,) = glob.glob(os.path.join(out, "*.gguf"))
            with open(path, "rb") as fh:
                put(d, gguf_header(fh.read()), "seed-" + name)
    finally:
        shutil.rmtree(tmp)


def small_llama3():
    """The Llama 3 tokenizer cut down to ids < 480 (byte-level BPE, Split regex + ByteLevel)."""
    with open(os.path.join(ROOT, "tests/data/llama3-tokenizer/tokenizer.json"), encoding="utf-8") as f:
        full = json.load(f)
    keep = 480
    vocab = {p: i for p, i in full["model"]["vocab"].items() if i < keep}
    merges = []
    for m in full["model"]["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    added = []
    for k, t in enumerate(full["added_tokens"][:8]):
        t = dict(t)
        t["id"] = keep + k
        added.append(t)
    # One of each flag the added-token matcher honours.
    added[5].update(content="<|eot_id|>", lstrip=True, rstrip=True)
    added[6].update(content="<tool>", single_word=True, special=False)
    tok = copy.deepcopy({k: v for k, v in full.items() if k not in ("model", "added_tokens")})
    tok["added_tokens"] = added
    model = dict(full["model"])
    model["vocab"] = vocab
    model["merges"] = merges
    tok["model"] = model
    pp = tok["post_processor"]
    pp["special_tokens"]["<|begin_of_text|>"]["ids"] = [keep]
    return tok


def tokenizer():
    d = clear("tokenizer")
    llama = small_llama3()
    put(d, json.dumps(llama, ensure_ascii=False))
    # GPT-2 style: ByteLevel with the GPT-2 regex, no ignore_merges, merges as pairs, no template.
    gpt2 = copy.deepcopy(llama)
    gpt2["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": True}
    gpt2["model"]["ignore_merges"] = False
    gpt2["model"]["merges"] = [m.split(" ") for m in gpt2["model"]["merges"]]
    gpt2["post_processor"] = None
    put(d, json.dumps(gpt2, ensure_ascii=True))
    # With a text after a NUL byte (fuzz_tokenizer encodes it).
    put(d, json.dumps(llama, ensure_ascii=False).encode() +
        b"\0Hello <|eot_id|> world <tool>x <tool> caf\xc3\xa9 \xff\xfe\n\n  12345")
    for sub in ("sp-legacy", "sp-metaspace"):
        with open(os.path.join(ROOT, "tests/unit/tokenizer/data", sub, "tokenizer.json"), "rb") as f:
            sp = f.read()
        put(d, sp)
        put(d, sp + b"\0 Hello  wor\xe2\x96\x81ld <s>\xf0\x9f\x98\x80x")
    # SentencePiece-style with the Metaspace decoder and a Strip after Fuse, unk fused.
    with open(os.path.join(ROOT, "tests/unit/tokenizer/data/sp-metaspace/tokenizer.json"), encoding="utf-8") as f:
        sp = json.load(f)
    sp["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    sp["model"]["fuse_unk"] = True
    sp["model"]["byte_fallback"] = False
    put(d, json.dumps(sp, ensure_ascii=False))
    # Tiny hand-written ones: near the edges of what loads.
    put(d, '{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}}')
    put(d, '{"model": {"vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]], "unk_token": "a"},'
           ' "added_tokens": [{"id": 3, "content": "<s>", "special": true}],'
           ' "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "b"},'
           ' {"type": "Replace", "pattern": {"String": " "}, "content": "a"}]},'
           ' "pre_tokenizer": {"type": "Metaspace", "replacement": "a", "prepend_scheme": "always", "split": true},'
           ' "decoder": {"type": "Metaspace", "replacement": "a", "prepend_scheme": "first"}}')
    put(d, '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "ignore_merges": true},'
           ' "pre_tokenizer": {"type": "Split", "pattern": {"String": "a"}, "behavior": "Isolated"},'
           ' "post_processor": {"type": "Sequence", "processors": [{"type": "TemplateProcessing",'
           ' "single": [{"SpecialToken": {"id": "a", "type_id": 0}}], "special_tokens": {"a": {"ids": [0]}}}]}}')


def sections(files):
    """fuzz_manifest's text form of a directory: [(name, option, bytes)]."""
    out = b""
    for name, opt, data in files:
        if isinstance(data, str):
            data = data.encode()
        out += b"@@@@ " + name.encode() + (b" " + opt.encode() if opt else b"") + b"\n" + data + b"\n"
    return out


def st_prefix(path):
    """The 8-byte length and the JSON header of a safetensors file, without the data."""
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        return head + f.read(n)


def st_make(header):
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h


def checkpoint(bin_dir, out, *args):
    subprocess.run([os.path.join(bin_dir, "make-synthetic-model"), "--shape", "tiny", "--out", out, "--quiet",
                    *args], check=True, stdout=subprocess.DEVNULL)
    files = []
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                files.append((name, "", f.read()))
    for p in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        files.append((os.path.basename(p), "fit", st_prefix(p)))
    return files


def manifest(bin_dir):
    d = clear("manifest")
    tmp = tempfile.mkdtemp()
    try:
        tiny = checkpoint(bin_dir, os.path.join(tmp, "tiny"))
        put(d, sections(tiny))
        put(d, sections(checkpoint(bin_dir, os.path.join(tmp, "sharded"), "--dtype", "f32", "--shards", "2",
                                   "--tied", "--layers", "1")))
        put(d, sections(checkpoint(bin_dir, os.path.join(tmp, "mistral"), "--dtype", "f16", "--arch", "mistral",
                                   "--sliding-window", "64", "--rope-scaling", "linear:2", "--mha",
                                   "--vocab", "300")))
        # The tiny checkpoint with a tokenizer.json whose ids fit its vocabulary (512).
        tok = json.dumps(small_llama3(), ensure_ascii=False, separators=(",", ":"))
        put(d, sections(tiny + [("tokenizer.json", "", tok)]))
        # Near-valid: the data cut one byte short; no generation_config and the config's
        # rope_scaling dropped; an extra ignored tensor and __metadata__ in the header.
        cfg = json.loads(tiny[0][2])
        st = [f for f in tiny if f[0] == "model.safetensors"][0][2]
        put(d, sections([tiny[0], ("model.safetensors", "short", st)]))
        cfg2 = dict(cfg, rope_scaling=None, tie_word_embeddings=True, eos_token_id=[2, 3])
        (n,) = struct.unpack("<Q", st[:8])
        header = json.loads(st[8:8 + n])
        header.pop("lm_head.weight", None)
        header["__metadata__"] = {"format": "pt"}
        header["model.layers.0.self_attn.rotary_emb.inv_freq"] = {"dtype": "F32", "shape": [8],
                                                                 "data_offsets": [0, 32]}
        put(d, sections([("config.json", "", json.dumps(cfg2)), ("model.safetensors", "fit", st_make(header))]))
        # One refusal each, past the first checks.
        put(d, sections([("config.json", "", json.dumps(dict(cfg, eos_token_id=list(range(9))))),
                         ("model.safetensors", "fit", st)]))
        put(d, sections([tiny[0], ("generation_config.json", "", "[1, 2]"), ("model.safetensors", "fit", st)]))
        put(d, sections([tiny[0], ("model.safetensors.index.json", "", '{"weight_map": {}}')]))
        bad = dict(header)
        bad["model.embed_tokens.weight"] = [1, 2]
        put(d, sections([tiny[0], ("model.safetensors", "fit", st_make(bad))]))
        bad = dict(header)
        bad["model.embed_tokens.weight"] = dict(header["model.embed_tokens.weight"], shape=[2] * 9)
        put(d, sections([tiny[0], ("model.safetensors", "fit", st_make(bad))]))
        # An index naming a file that is a directory, and a file that is not there.
        idx = [f for f in checkpoint(bin_dir, os.path.join(tmp, "sh2"), "--shards", "2") if f[0].endswith(".json")]
        put(d, sections(idx + [("model-00001-of-00002.safetensors/", "", b"")]))
        # A directory holding one GGUF file and no safetensors checkpoint (corpus/gguf first).
        with open(os.path.join(CORPUS, "gguf", "seed-tiny-q8_0-tied"), "rb") as f:
            put(d, sections([("tiny.gguf", "fit", f.read())]))
    finally:
        shutil.rmtree(tmp)


def jinja():
    """The chat templates of tests/unit/jinja and its one-feature templates (with their variables
    after a NUL byte), from cases.json."""
    d = clear("jinja")
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "unit", "jinja", "templates", "*.jinja"))):
        with open(path, "rb") as f:
            put(d, f.read(), os.path.basename(path))
    with open(os.path.join(ROOT, "tests", "unit", "jinja", "cases.json"), encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    for c in cases:
        if "template" in c and "parse_error" not in c:
            data = c["template"].encode()
            if c.get("vars"):
                data += b"\0" + json.dumps(c["vars"]).encode()
            put(d, data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fuzz-build", default=os.path.join(ROOT, "build-fuzz"),
                    help="the PIPELINE_FUZZ build directory (for make_codec_seeds)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"),
                    help="bin directory of the main build (for make-synthetic-model)")
    ap.add_argument("targets", nargs="*", default=["codec", "tokenizer", "gguf", "manifest", "jinja"],
                    help="the corpora to write (default: all)")
    a = ap.parse_args()
    if "codec" in a.targets:
        codec(a.fuzz_build)
    if "tokenizer" in a.targets:
        tokenizer()
    if "gguf" in a.targets:
        gguf(a.fuzz_build, a.bin)
    if "manifest" in a.targets:
        manifest(a.bin)
    if "jinja" in a.targets:
        jinja()
    total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(CORPUS, "*", "*")))
    print(f"make-corpus: {total} bytes in {CORPUS}", file=sys.stderr)


if __name__ == "__main__":
    main()

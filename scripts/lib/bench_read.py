"""bench_read - what scripts/bench reads, with no GPU and no services: the statistics pipectl
prints, a checkpoint's tensors (safetensors headers, GGUF), the --strict and sanitizer logs, and
the prompts it sends. scripts/bench imports it (and its test through scripts/bench)."""
import functools
import glob
import json
import os
import re
import struct
import sys
import time

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


class BenchError(Exception):
    pass


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Reading what the tools print (pure: no GPU, no services)
# ---------------------------------------------------------------------------------------------

GEN_KEYS = ("prompt_tokens", "prefill_ms", "tokens_generated", "decode_ms")


def parse_gen_stats(stderr):
    """The statistics of `pipectl generate --stats --json`: a JSON object on a line of its own
    on stderr (prompt_tokens, prefill_ms, tokens_generated, decode_ms: the decode loop's whole
    time, ...). Returns a dict with prompt_tokens, prefill_ms, generated_tokens, decode_total_ms
    and decode_ms, the milliseconds per decode step (the loop's time over generated_tokens - 1
    steps: the first token comes from the prefill), besides what pipectl printed."""
    for line in reversed(stderr.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        missing = [k for k in GEN_KEYS if not isinstance(obj.get(k), (int, float)) or isinstance(obj.get(k), bool)]
        if missing:
            raise BenchError(f"generate statistics lack {', '.join(missing)}: {line}")
        g = dict(obj)
        n = g.pop("tokens_generated")
        total = float(g["decode_ms"])
        g.update(generated_tokens=n, decode_total_ms=total, decode_ms=total / (n - 1) if n > 1 else 0.0)
        return g
    raise BenchError("pipectl generate printed no statistics object (--stats --json)")


def decode_per_token_ms(g):
    return float(g["decode_ms"])


def decode_total_ms(g):
    """The decode loop's whole time: what the weight copies' busy time is set against."""
    if isinstance(g.get("decode_total_ms"), (int, float)):
        return float(g["decode_total_ms"])
    return float(g["decode_ms"]) * (g["generated_tokens"] - 1)


def safetensors_header(path):
    """The JSON header of a .safetensors file: an 8-byte little-endian length, then the object."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise BenchError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise BenchError(f"{path}: header of {n} bytes")
        text = f.read(n)
    if len(text) != n:
        raise BenchError(f"{path}: header cut short")
    return json.loads(text)


# GGUF: (values per block, bytes per block) of the ggml types the pipeline reads.
GGUF_TYPES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144), 13: (256, 176),
              14: (256, 210)}
GGUF_EMBED, GGUF_OUTPUT = "token_embd.weight", "output.weight"


def gguf_file(model):
    """The GGUF file a --model path names (a .gguf file, or a directory holding one; the first
    file of a split set), or None for a safetensors checkpoint."""
    if model.endswith(".gguf") and os.path.isfile(model):
        return model
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        files = sorted(glob.glob(os.path.join(model, "*.gguf")))
        if files:
            return files[0]
    return None


@functools.lru_cache(maxsize=None)
def gguf_read(path):
    """The metadata (scalars and array lengths) and tensors {name: (shape rows-first, elements,
    bytes)} of a GGUF file and of the rest of its split set."""
    def rd(f, fmt):
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, f.read(size))

    def string(f):
        (n,) = rd(f, "Q")
        return f.read(n).decode("utf-8", "replace")

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(f, t):
        if t == 8:
            return string(f)
        if t == 9:
            (et, n) = rd(f, "IQ")
            items = [value(f, et) for _ in range(n)]
            return len(items)
        return rd(f, scalar[t])[0]

    meta, tensors = {}, {}
    paths = [path]
    m = re.match(r"(.*)-00001-of-(\d{5})\.gguf$", path)
    if m:
        paths = [f"{m.group(1)}-{i:05d}-of-{m.group(2)}.gguf" for i in range(1, int(m.group(2)) + 1)]
    for p in paths:
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                raise BenchError(f"{p}: not a GGUF file")
            (_, nt, nkv) = rd(f, "IQQ")
            for _ in range(nkv):
                k = string(f)
                (t,) = rd(f, "I")
                v = value(f, t)
                meta.setdefault(k, v)
            for _ in range(nt):
                name = string(f)
                (nd,) = rd(f, "I")
                ne = rd(f, "Q" * nd)
                (t, _) = rd(f, "IQ")
                if t not in GGUF_TYPES:
                    raise BenchError(f"{p}: tensor {name} has ggml type {t}")
                elems = 1
                for d in ne:
                    elems *= d
                per, size = GGUF_TYPES[t]
                tensors[name] = (list(reversed(ne)), elems, elems // per * size)
    return meta, tensors


def checkpoint_weights(model_dir):
    """What the checkpoint says about the work of a token, from config.json and the safetensors
    headers (each tensor's shape and its bytes, data_offsets end - start):
      weight_bytes: every tensor's bytes;
      bytes_per_token: the bytes a decode token reads: every tensor once, except that of the
        token embedding it reads one row (when lm_head is a tensor of its own; tied, the
        embedding is read whole as the output head);
      matrix_params: the elements of the matrices a prompt token multiplies (the 2-D tensors
        but the untied embedding), for the prefill's FLOPs: 2 per element per token."""
    gguf = gguf_file(model_dir)
    embed, lm_head = (GGUF_EMBED, GGUF_OUTPUT) if gguf else (EMBED, LM_HEAD)
    tensors = {}
    if gguf:
        meta, tensors = gguf_read(gguf)  # cached: a request reads the header once per run
        tensors = {k: v for k, v in tensors.items() if k != "rope_freqs.weight"}  # a table the loader reads once, not a weight
        files = [gguf]
        config = {"vocab_size": meta.get("llama.vocab_size") or tensors[GGUF_EMBED][0][0]}
    else:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise BenchError(f"{model_dir}: no .safetensors files")
    for path in files if not gguf else []:
        for name, t in safetensors_header(path).items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            elems = 1
            for d in t["shape"]:
                elems *= d
            tensors[name] = (t["shape"], elems, end - start)
    if embed not in tensors:
        raise BenchError(f"{model_dir}: no {embed}")
    untied = lm_head in tensors
    weight_bytes = sum(b for _, _, b in tensors.values())
    embed_shape, _, embed_bytes = tensors[embed]
    per_token = weight_bytes - embed_bytes + embed_bytes // embed_shape[0] if untied else weight_bytes
    matrix = sum(e for name, (shape, e, _) in tensors.items() if len(shape) >= 2 and not (untied and name == embed))
    return {
        "model": os.path.basename(os.path.normpath(model_dir)),
        "files": len(files),
        "tensors": len(tensors),
        "vocab_size": config.get("vocab_size"),
        "tied_embeddings": not untied,
        "params": sum(e for _, e, _ in tensors.values()),
        "matrix_params": matrix,
        "weight_bytes": weight_bytes,
        "bytes_per_token": per_token,
        # mixture of experts: the experts' bytes, how many a layer has and a token chooses
        "expert_bytes": sum(b for name, (_, _, b) in tensors.items() if ".experts." in name or "_exps." in name),
        "experts": config.get("num_experts") or config.get("num_local_experts") or 0,
        "experts_used": config.get("num_experts_per_tok") or 0,
    }


def count_strict(log_text):
    """Lines of the runner's log where --strict found an invariant broken."""
    return sum(1 for line in log_text.splitlines() if "--strict:" in line)


def sanitizer_summary(tool, log_text):
    """compute-sanitizer's last summary line; for racecheck, with the hazards in the project's
    kernels and in cuBLAS's own (nvjet, which racecheck cannot follow: docs/benchmarks.md)."""
    summary = ""
    for line in log_text.splitlines():
        if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line:
            summary = line.lstrip("=").lstrip(" ")
    if tool == "racecheck":
        races = [line for line in log_text.splitlines() if "Race reported" in line]
        theirs = sum(1 for line in races if "nvjet" in line)
        ours = len(races) - theirs
        summary = f"{summary or 'no summary'}; hazards in the project's kernels: {ours} (cuBLAS nvjet: {theirs})"
    return summary


# Prompts: ids spread over a vocabulary, the same every run.
def prompt_ids(n, vocab):
    return [(i * 7919 + 13) % (vocab - 1000) + 500 for i in range(n)]


def spread_ids(n, offset, vocab=128256):
    """n prompt ids spread over the vocabulary (a Llama 3 one's first 127500 past id 500, a smaller
    one's all but its last 500)."""
    return [((i + offset) * 7919 + 13) % min(127000, vocab - 1000) + 500 for i in range(n)]


def k2_prompts():
    """Two prompts sharing an 8192-token prefix, then 64 tokens each of their own."""
    pre = [(i * 7919 + 13) % 127000 + 500 for i in range(8192)]
    a = [(i * 104729 + 7) % 127000 + 500 for i in range(64)]
    b = [(i * 1299709 + 3) % 127000 + 500 for i in range(64)]
    return pre + a, pre + b


def ids_text(ids):
    return ",".join(map(str, ids))

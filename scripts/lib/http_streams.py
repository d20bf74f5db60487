"""http_streams - N streamed completions sent at once to an OpenAI-compatible server (http-api),
each timed: when it was sent, when its first text came (time to first token), when it ended, and
how many tokens it got (its stream's usage chunk). Python's standard library only (http.client,
threads): scripts/bench runs it on a host with no network.

    from http_streams import run_streams, summarize
    results = run_streams("http://127.0.0.1:8000", 16, "The capital of France is", 128)
    s = summarize(results)   # tokens_per_s (all of them over the whole wall time), ttft_p50_s, ...
"""
import http.client
import json
import threading
import time
import urllib.parse


def one_stream(base, prompt, max_tokens, timeout_s, out, start_barrier=None):
    """One streamed completion with ignore_eos (every request gets max_tokens tokens); fills out
    with sent, first (the first text chunk), done (monotonic seconds), tokens, error."""
    u = urllib.parse.urlparse(base)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True})
    if start_barrier:
        start_barrier.wait()
    out.update(sent=time.monotonic(), first=None, done=None, tokens=0, error=None)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read(300)!r}"
            return
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                out["error"] = obj["error"].get("message", "error")
                return
            if out["first"] is None and any(c.get("text") for c in obj.get("choices", [])):
                out["first"] = time.monotonic()
            if obj.get("usage"):
                out["tokens"] = int(obj["usage"]["completion_tokens"])
        out["done"] = time.monotonic()
    except (OSError, ValueError, http.client.HTTPException) as e:
        out["error"] = str(e)
    finally:
        conn.close()


def run_streams(base, n, prompt, max_tokens, timeout_s=3600):
    """n streams sent at once (released together by a barrier); their results in a list."""
    results = [dict() for _ in range(n)]
    barrier = threading.Barrier(n)
    threads = [threading.Thread(target=one_stream, args=(base, prompt, max_tokens, timeout_s, results[i], barrier))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def percentile(values, q):
    if not values:
        return 0.0
    v = sorted(values)
    k = min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))
    return v[k]


def summarize(results):
    """Aggregate tokens per second (every stream's tokens over the wall time from the first send to
    the last end), time to first token (p50, max), the failures."""
    ok = [r for r in results if not r.get("error") and r.get("done")]
    errors = [r["error"] for r in results if r.get("error")]
    if not ok:
        return {"streams": len(results), "ok": 0, "errors": errors[:3], "tokens": 0, "tokens_per_s": 0.0,
                "ttft_p50_s": 0.0, "ttft_max_s": 0.0, "wall_s": 0.0}
    t0 = min(r["sent"] for r in ok)
    t1 = max(r["done"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["first"] - r["sent"] for r in ok if r.get("first")]
    wall = t1 - t0
    return {"streams": len(results), "ok": len(ok), "errors": errors[:3], "tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0, "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_max_s": max(ttft) if ttft else 0.0, "wall_s": wall}

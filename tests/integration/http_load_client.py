#!/usr/bin/env python3
"""http_load_client.py - the load of http_load.sh: many requests at once against http-api.

Usage: http_load_client.py BASE_URL OUT_JSON [--count N] [--concurrency C] [--disconnect-every K]
                           [--seed S] [--refs-out FILE] [--refs-in FILE]

A few request shapes (completions and chat, greedy and seeded, max_tokens 1..24) are first sent
alone, each both streamed and not: the two answers must agree, and give the shape's reference
(text, finish_reason, completion_tokens). Then COUNT requests drawn from the shapes, streamed or
not, CONCURRENCY at a time; about one in K is a client that closes its socket after the first
event of its stream (none with K 0). Every other answer must be complete and well formed (status 200, the JSON of
a reply or an event stream of JSON chunks ending in data: [DONE]) and equal its shape's reference.

--refs-out keeps the references; --refs-in checks that they equal those kept (the same server
answering the same after the load). Python's standard library only. Writes a summary to OUT_JSON
({"sent", "disconnects", "ok", "checked", "failures": [...]}) and exits 1 when any request failed, 2 on
a bad reference.
"""
import argparse
import concurrent.futures
import http.client
import json
import random
import socket
import sys
import urllib.parse

TIMEOUT_S = 60  # a bound on a hung request, not a measurement

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello"]
SHAPES = [
    # (endpoint, body without stream fields)
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 7, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 7}),
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.8, "seed": 11}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 3,
                              "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": PROMPTS[1]}],
                              "max_tokens": 12, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 20,
                              "temperature": 1.0, "seed": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}],
                              "max_completion_tokens": 24, "temperature": 0.7, "seed": 5}),
]


class Bad(Exception):
    pass


def connect(base):
    u = urllib.parse.urlsplit(base)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)


def body_of(shape, stream, usage):
    body = dict(SHAPES[shape][1])
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def post(base, shape, stream, usage=False):
    c = connect(base)
    c.request("POST", SHAPES[shape][0], body=body_of(shape, stream, usage),
              headers={"Content-Type": "application/json"})
    return c, c.getresponse()


def chunk_text(chunk):
    ch = chunk.get("choices") or []
    if not ch:
        return ""
    c = ch[0]
    if "text" in c:
        return c["text"] or ""
    return (c.get("delta") or {}).get("content") or ""


def answer_plain(base, shape):
    """A request that does not stream: (text, finish_reason, completion_tokens)."""
    c, r = post(base, shape, False)
    try:
        data = r.read()
        if r.status != 200:
            raise Bad("status %d: %.300s" % (r.status, data))
        try:
            o = json.loads(data)
        except ValueError:
            raise Bad("not JSON: %.300s" % data)
        want = "text_completion" if SHAPES[shape][0] == "/v1/completions" else "chat.completion"
        if o.get("object") != want:
            raise Bad("object %r, want %r" % (o.get("object"), want))
        ch = o["choices"][0]
        text = ch["text"] if "text" in ch else ch["message"]["content"]
        u = o["usage"]
        if u["prompt_tokens"] + u["completion_tokens"] != u["total_tokens"]:
            raise Bad("usage does not add up: %r" % u)
        return text, ch["finish_reason"], u["completion_tokens"]
    finally:
        c.close()


def answer_stream(base, shape, usage):
    """A streamed request read to its end: (text, finish_reason, completion_tokens or None)."""
    c, r = post(base, shape, True, usage)
    try:
        if r.status != 200:
            raise Bad("status %d: %.300s" % (r.status, r.read()))
        ctype = r.getheader("Content-Type", "")
        if not ctype.startswith("text/event-stream"):
            raise Bad("content type %r" % ctype)
        raw = r.read().decode()
    finally:
        c.close()
    if not raw.endswith("\n\n"):
        raise Bad("the stream does not end with an event: %r" % raw[-200:])
    events = raw[:-2].split("\n\n")
    if events[-1] != "data: [DONE]":
        raise Bad("the last event is %r, not data: [DONE]" % events[-1][:200])
    text, finish, n = "", None, None
    want = "text_completion" if SHAPES[shape][0] == "/v1/completions" else "chat.completion.chunk"
    for ev in events[:-1]:
        if not ev.startswith("data: "):
            raise Bad("an event that is not data: %r" % ev[:200])
        try:
            o = json.loads(ev[6:])
        except ValueError:
            raise Bad("an event that is not JSON: %r" % ev[:200])
        if "error" in o:
            raise Bad("an error event: %r" % ev[:300])
        if o.get("object") != want:
            raise Bad("chunk object %r, want %r" % (o.get("object"), want))
        text += chunk_text(o)
        ch = o.get("choices") or []
        if ch and ch[0].get("finish_reason"):
            if finish is not None:
                raise Bad("two chunks with a finish_reason")
            finish = ch[0]["finish_reason"]
        if o.get("usage"):
            n = o["usage"]["completion_tokens"]
    if finish is None:
        raise Bad("no chunk with a finish_reason")
    if usage and n is None:
        raise Bad("include_usage, but no usage chunk")
    return text, finish, n


def disconnect(base, shape):
    """A streamed request whose client closes its socket after the first event."""
    c, r = post(base, shape, True)
    try:
        if r.status != 200:
            raise Bad("status %d: %.300s" % (r.status, r.read()))
        line = r.readline()
        if not line.startswith(b"data: {"):
            raise Bad("the first line is %r" % line[:200])
    finally:
        try:
            c.sock and c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        c.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--disconnect-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--refs-out", help="write the shapes' reference answers to this file")
    ap.add_argument("--refs-in", help="the reference answers must equal those in this file (--refs-out)")
    a = ap.parse_args()

    refs = []
    for i in range(len(SHAPES)):
        try:
            plain = answer_plain(a.base, i)
            streamed = answer_stream(a.base, i, True)
        except (Bad, OSError, KeyError, TypeError, IndexError) as e:
            print("reference of shape %d: %s" % (i, e), file=sys.stderr)
            return 2
        if plain != streamed:
            print("shape %d: alone, streamed %r and not %r differ" % (i, streamed, plain), file=sys.stderr)
            return 2
        limit = SHAPES[i][1].get("max_tokens", SHAPES[i][1].get("max_completion_tokens"))
        if plain[1] == "length" and plain[2] != limit:
            print("shape %d: finish length after %d tokens, max_tokens %d" % (i, plain[2], limit), file=sys.stderr)
            return 2
        print("shape %d %s max_tokens %d: %d tokens, %s, %r" % (i, SHAPES[i][0], limit, plain[2], plain[1],
                                                                 plain[0][:40]))
        refs.append(plain)
    if a.refs_out:
        with open(a.refs_out, "w") as f:
            json.dump(refs, f)
    if a.refs_in:
        with open(a.refs_in) as f:
            old = [tuple(r) for r in json.load(f)]
        if old != refs:
            print("the reference answers changed: %r, before %r" % (refs, old), file=sys.stderr)
            return 2

    rng = random.Random(a.seed)
    n_cut = a.count // a.disconnect_every if a.disconnect_every > 0 else 0
    cuts = set(rng.sample(range(a.count), n_cut))
    # The clients that go away take the shapes of 12 tokens and more: a first event then comes
    # before the end (their generation may still end before the close is seen).
    long_shapes = [i for i, (_, b) in enumerate(SHAPES) if b.get("max_tokens", b.get("max_completion_tokens")) >= 12]
    plan = []
    for k in range(a.count):
        if k in cuts:
            plan.append((k, rng.choice(long_shapes), "cut", False))
        else:
            plan.append((k, rng.randrange(len(SHAPES)), rng.choice(["plain", "stream"]), rng.random() < 0.5))

    def one(item):
        k, shape, how, usage = item
        try:
            if how == "cut":
                disconnect(a.base, shape)
                return None
            got = answer_plain(a.base, shape) if how == "plain" else answer_stream(a.base, shape, usage)
            want = refs[shape]
            if got[0] != want[0] or got[1] != want[1] or (got[2] is not None and got[2] != want[2]):
                return "request %d (shape %d, %s): got %r, want %r" % (k, shape, how, got, want)
            return None
        except (Bad, OSError, http.client.HTTPException, KeyError, TypeError, IndexError, ValueError) as e:
            return "request %d (shape %d, %s): %s: %s" % (k, shape, how, type(e).__name__, e)

    with concurrent.futures.ThreadPoolExecutor(max_workers=a.concurrency) as ex:
        results = list(ex.map(one, plan))
    failures = [r for r in results if r]
    summary = {"sent": a.count, "disconnects": n_cut, "ok": a.count - len(failures),
               "checked": a.count - n_cut, "reference_requests": 2 * len(SHAPES), "failures": failures}
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    for fl in failures[:20]:
        print(fl, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

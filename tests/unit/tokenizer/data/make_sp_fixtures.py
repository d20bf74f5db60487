#!/usr/bin/env python3
"""Writes the SentencePiece-style tokenizer.json fixtures of test_tokenizer_sp.c (run once; the
JSON files are checked in, the tests never run this).

One small vocabulary in two layouts:
  sp-legacy/tokenizer.json     Llama 2 as Hugging Face converts it (legacy): normalizer
                               Sequence[Prepend("▁"), Replace(" ", "▁")], no pre_tokenizer.
  sp-metaspace/tokenizer.json  Mistral / Llama 2 with legacy=false: pre_tokenizer Metaspace
                               (prepend_scheme "first", split false), no normalizer.
Both: model BPE with unk_token <unk>, fuse_unk, byte_fallback; decoder Sequence[Replace("▁",
" "), ByteFallback, Fuse, Strip(" ", 1, 0)]; post_processor TemplateProcessing with <s> first.

Ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF> (byte b is id 3 + b), 259.. the characters
below, then one piece per merge, in merge order (merge rank r makes id 278 + r)."""
import json, os

B = "\u2581"  # ▁
chars = [B, "e", "t", "h", "l", "o", "H", "w", "r", "d", "a", "n", "i", "s", ",", "!", "\u00e9", "c", "f"]
merges = [  # rank: pair
    (B, "t"), ("h", "e"), (B + "t", "he"), ("l", "l"), (B, "H"), ("e", "ll"), (B + "H", "ell"),
    (B + "Hell", "o"), ("o", "r"), (B, "w"), (B + "w", "or"), (B + "wor", "l"), (B + "worl", "d"),
    ("t", "h"), ("o", B), ("a", "n"), ("i", "n"),
]
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for b in range(256):
    vocab["<0x%02X>" % b] = 3 + b
for c in chars:
    vocab[c] = len(vocab)
for a, b in merges:
    assert a in vocab and b in vocab, (a, b)
    vocab[a + b] = len(vocab)

def added(i, s):
    return {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}

def doc(layout):
    d = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": B}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "vocab": vocab, "merges": ["%s %s" % m for m in merges]},
    }
    if layout == "legacy":
        d["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": B},
            {"type": "Replace", "pattern": {"String": " "}, "content": B},
        ]}
    else:
        d["pre_tokenizer"] = {"type": "Metaspace", "replacement": B, "prepend_scheme": "first", "split": False}
    return d

here = os.path.dirname(os.path.abspath(__file__))
for layout in ("legacy", "metaspace"):
    os.makedirs(os.path.join(here, "sp-" + layout), exist_ok=True)
    with open(os.path.join(here, "sp-" + layout, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(doc(layout), f, ensure_ascii=False, indent=2)
        f.write("\n")
print(len(vocab), "pieces,", len(merges), "merges")

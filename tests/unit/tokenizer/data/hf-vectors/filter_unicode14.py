#!/usr/bin/env python3
"""Drops the cases of a vectors file whose text holds a character that Unicode 14 leaves
unassigned. Debian 12's PCRE2 (10.42) has Unicode 14 tables, Hugging Face a newer Unicode: on
such characters \\p{L} and \\p{N} differ, which is a library version, not the tokenizer."""
import json, sys, unicodedata
assert unicodedata.unidata_version == "14.0.0", unicodedata.unidata_version
path = sys.argv[1]
cases = json.load(open(path, encoding="utf-8"))
kept = [c for c in cases if all(unicodedata.category(ch) != "Cn" for ch in c["text"])]
with open(path, "w", encoding="ascii") as f:  # one case a line
    f.write("[\n" + ",\n".join(json.dumps(c, ensure_ascii=True, separators=(",", ":")) for c in kept) + "\n]\n")
print(path, len(cases), "->", len(kept))

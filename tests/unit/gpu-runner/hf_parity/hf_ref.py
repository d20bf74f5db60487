# hf_ref.py OUT_DIR - builds small random Llama / Mistral models in transformers (float32, CPU), runs a
# prompt through each and dumps weights, tokens, RoPE inv_freq and last-position logits for hf_check.c.
import os, sys
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

out = sys.argv[1]
major = int(transformers.__version__.split('.')[0])
print("torch", torch.__version__, "transformers", transformers.__version__, flush=True)

def make_cfg(cls, kw, rope):
    kw = dict(kw)
    theta = rope.pop("rope_theta")
    if major >= 5:
        rp = {"rope_theta": theta, "rope_type": rope.get("rope_type", "default")}
        rp.update(rope)
        return cls(**kw, rope_parameters=rp)
    return cls(**kw, rope_theta=theta, rope_scaling=(rope if rope.get("rope_type", "default") != "default" else None))

cases = []
def case(name, arch="llama", hidden=64, heads=4, kv=2, hd=16, ffn=192, vocab=512, layers=2, rope=None,
         tie=False, wdtype="F32", n=37, pos0=0, window=0, attn="eager", seed=0):
    cases.append(dict(name=name, arch=arch, hidden=hidden, heads=heads, kv=kv, hd=hd, ffn=ffn, vocab=vocab,
                      layers=layers, rope=rope or {"rope_theta": 10000.0, "rope_type": "default"}, tie=tie,
                      wdtype=wdtype, n=n, pos0=pos0, window=window, attn=attn, seed=seed))

L3small = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
L3real = dict(L3small, original_max_position_embeddings=8192)
case("gqa_llama3_small", rope=dict(L3small))
case("gqa_llama3_small_sdpa", rope=dict(L3small), attn="sdpa")
case("gqa_llama3_pos100000", rope=dict(L3small), pos0=100000)
case("mha_tied_linear_bf16", heads=4, kv=4, tie=True, wdtype="BF16", pos0=5000,
     rope={"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0})
case("f16_default", wdtype="F16", pos0=17)
case("headdim32", hd=32)
case("mistral_window8", arch="mistral", window=8, n=40)
case("medium_llama3real", hidden=512, heads=8, kv=2, hd=64, ffn=1408, vocab=4096, layers=4, rope=dict(L3real), n=64)
case("medium_llama3real_bf16_pos30000", hidden=512, heads=8, kv=2, hd=64, ffn=1408, vocab=4096, layers=4,
     rope=dict(L3real), n=64, pos0=30000, wdtype="BF16")
case("hd128_llama3real_pos120000", hidden=256, heads=2, kv=1, hd=128, ffn=768, vocab=1024, layers=2,
     rope=dict(L3real), n=33, pos0=120000)

def save(path, t, dtype):
    t = t.detach().contiguous()
    if dtype == "F32":
        t.float().numpy().tofile(path)
    elif dtype == "BF16":
        t.bfloat16().view(torch.int16).numpy().tofile(path)
    else:
        t.half().view(torch.int16).numpy().tofile(path)

for c in cases:
    torch.manual_seed(c["seed"])
    kw = dict(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"], num_hidden_layers=c["layers"],
              num_attention_heads=c["heads"], num_key_value_heads=c["kv"], head_dim=c["hd"], rms_norm_eps=1e-5,
              max_position_embeddings=131072, tie_word_embeddings=c["tie"], attn_implementation=c["attn"])
    if c["arch"] == "mistral":
        kw["sliding_window"] = c["window"]
        cfg = make_cfg(MistralConfig, kw, dict(c["rope"]))
        model = MistralForCausalLM(cfg)
    else:
        cfg = make_cfg(LlamaConfig, kw, dict(c["rope"]))
        model = LlamaForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.02)
            if c["wdtype"] == "BF16":
                p.copy_(p.bfloat16().float())
            elif c["wdtype"] == "F16":
                p.copy_(p.half().float())
    d = os.path.join(out, c["name"])
    os.makedirs(d, exist_ok=True)
    sd = model.state_dict()
    for name, t in sd.items():
        if "rotary" in name:
            continue
        save(os.path.join(d, name + ".bin"), t, c["wdtype"])
    rot = model.model.rotary_emb
    rot.inv_freq.float().numpy().tofile(os.path.join(d, "inv_freq.bin"))
    g = torch.Generator().manual_seed(123 + c["seed"])
    tok = torch.randint(0, c["vocab"], (1, c["n"]), generator=g)
    pos = torch.arange(c["pos0"], c["pos0"] + c["n"])[None]
    with torch.no_grad():
        logits = model(input_ids=tok, position_ids=pos, use_cache=False).logits[0, -1].float()
    tok.to(torch.int32).numpy().tofile(os.path.join(d, "tokens.bin"))
    logits.numpy().tofile(os.path.join(d, "logits.bin"))
    r = c["rope"]
    scaling = {"default": 0, "linear": 1, "llama3": 2}[r.get("rope_type", "default")]
    with open(os.path.join(d, "config.txt"), "w") as f:
        for k, v in [("layers", c["layers"]), ("dim", c["hidden"]), ("heads", c["heads"]), ("kv_heads", c["kv"]),
                     ("head_dim", c["hd"]), ("ffn", c["ffn"]), ("vocab", c["vocab"]), ("eps", 1e-5),
                     ("theta", r["rope_theta"]), ("scaling", scaling), ("factor", r.get("factor", 0)),
                     ("low", r.get("low_freq_factor", 0)), ("high", r.get("high_freq_factor", 0)),
                     ("orig", r.get("original_max_position_embeddings", 0)), ("tie", int(c["tie"])),
                     ("window", c["window"]), ("wdtype", {"F32": 0, "F16": 1, "BF16": 2}[c["wdtype"]]),
                     ("n", c["n"]), ("pos0", c["pos0"])]:
            f.write(f"{k} {v}\n")
    print(c["name"], "rope_type", getattr(rot, "rope_type", "?"), "attn", model.config._attn_implementation,
          "inv_freq[:3]", rot.inv_freq[:3].tolist(), "|logits|max", float(logits.abs().max()), flush=True)

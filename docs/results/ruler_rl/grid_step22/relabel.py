"""Move grid_default's step-22 memagent_rl rows to grid_step22/ and put the deep-needle adapter's probe rows
(probe_deep4k/, the same adapter bytes now packaged as ruler-niah) in their place under memagent_rl's new hash."""
import json, shutil
from pathlib import Path
from memagent.eval.grid import EvalConfig

R = Path("docs/results/ruler_rl")
G, S, P = R / "grid_default", R / "grid_step22", R / "probe_deep4k"
cfg = EvalConfig.from_yaml("configs/eval_ruler_rl_default.yaml")
new = {m.name: cfg.method_hash(m) for m in cfg.methods}["memagent_rl"]
rows = [json.loads(l) for l in open(G / "results.jsonl", encoding="utf-8")]
old = [r for r in rows if r["method"] == "memagent_rl"]
keep = [r for r in rows if r["method"] != "memagent_rl"]
S.mkdir(exist_ok=True)
with open(S / "results.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in old)
probe = [json.loads(l) for l in open(P / "results.jsonl", encoding="utf-8")]
for r in probe:
    assert r["method"] == "memagent_rl_deep4k"
    r["method"], r["method_hash"] = "memagent_rl", new
    r["trace"] = r["trace"].replace("traces/memagent_rl_deep4k/", "traces/memagent_rl/")
with open(G / "results.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in keep + probe)
(S / "traces").mkdir(exist_ok=True)
shutil.move(str(G / "traces" / "memagent_rl"), str(S / "traces" / "memagent_rl"))
shutil.copytree(P / "traces" / "memagent_rl_deep4k", G / "traces" / "memagent_rl")
m = json.loads((G / "manifest.json").read_text(encoding="utf-8"))
m["method_hashes"]["memagent_rl"] = new
(G / "manifest.json").write_text(json.dumps(m, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
print("old rows", len(old), "new rows", len(probe), "hash", new)

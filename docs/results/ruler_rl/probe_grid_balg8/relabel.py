"""Package the candidate: move grid_default's step-26 memagent_rl rows and traces to grid_step26/ and put this
probe's rows (memagent_rl_balg8, made through runs/export_bal_g8_s4/adapter.gguf: the same bytes as the newly
packaged ruler-niah) in their place under memagent_rl and the hash the packaged policy now gives (the path string
enters the hash, so the probe's own is another). Run from the repository root with PYTHONPATH=src, after copying
train_bal2k_g8/adapter.gguf over src/memagent/policies/ruler-niah/adapter.gguf, and only once the probe has all
10 cells. The same steps as grid_step22/relabel.py."""
import json, shutil
from pathlib import Path
from memagent.eval.grid import EvalConfig

R = Path("docs/results/ruler_rl")
G, S, P = R / "grid_default", R / "grid_step26", R / "probe_grid_balg8"
cfg = EvalConfig.from_yaml("configs/eval_ruler_rl_default.yaml")
new = {m.name: cfg.method_hash(m) for m in cfg.methods}["memagent_rl"]
rows = [json.loads(l) for l in open(G / "results.jsonl", encoding="utf-8")]
old = [r for r in rows if r["method"] == "memagent_rl"]
assert new not in {r["method_hash"] for r in old}, "the package still holds the step-26 adapter"
keep = [r for r in rows if r["method"] != "memagent_rl"]
probe = [json.loads(l) for l in open(P / "results.jsonl", encoding="utf-8")]
cells = {(r["task"], r["length"]) for r in probe}
assert len(probe) == 160 and len(cells) == 10, f"probe incomplete: {len(probe)} rows in {len(cells)} cells"
S.mkdir(exist_ok=True)
with open(S / "results.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in old)
for r in probe:
    assert r["method"] == "memagent_rl_balg8"
    r["method"], r["method_hash"] = "memagent_rl", new
    r["trace"] = r["trace"].replace("traces/memagent_rl_balg8/", "traces/memagent_rl/")
with open(G / "results.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in keep + probe)
(S / "traces").mkdir(exist_ok=True)
shutil.move(str(G / "traces" / "memagent_rl"), str(S / "traces" / "memagent_rl"))
shutil.copytree(P / "traces" / "memagent_rl_balg8", G / "traces" / "memagent_rl")
m = json.loads((G / "manifest.json").read_text(encoding="utf-8"))
m["method_hashes"]["memagent_rl"] = new
(G / "manifest.json").write_text(json.dumps(m, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
print("old rows", len(old), "new rows", len(probe), "hash", new)

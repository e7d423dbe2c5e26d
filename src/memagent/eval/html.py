"""A self-contained HTML report of a run: accuracy plot, diagnostics table and a per-sample memory timeline.

One file, no network and no external assets: CSS and JavaScript inline, the plot a base64 PNG, the samples a
JSON block that the page's script renders on demand. ``#sample=N`` in the URL opens sample ``N``'s view (the
list's links set it), ``#outcome=never_captured`` filters the list, so any view can be linked to or opened
by a headless browser.

The per-sample view shows the question, the gold answers, the final answer and its score, the outcome class
(:mod:`memagent.eval.diagnostics`), and for memory-agent rows one line per update: the chunk read (marked when
it holds evidence), the memory written with what changed from the previous memory highlighted (a word diff),
its tokens and whether it hit the cap, and which targets the memory holds.
"""

from __future__ import annotations

import base64
import difflib
import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from memagent.eval.diagnostics import OUTCOMES, CellDiagnostics, SampleDiagnosis, TargetStatus, format_split
from memagent.eval.metrics import length_with_unit

#: Readable names of the outcome classes.
OUTCOME_LABELS = {
    "correct": "correct", "retained_wrong": "retained, answered wrong", "captured_then_lost": "captured then lost",
    "never_captured": "never captured", "not_read": "evidence not read", "in_view_wrong": "in view, answered wrong",
    "unmeasured": "not measured", "error": "error",
}

#: Columns of the diagnostics table: (header, CellDiagnostics attribute or outcome class, kind).
DIAG_COLUMNS = (
    ("read %", "read_pct", "pct"), ("captured %", "captured_pct", "pct"), ("retained %", "retained_pct", "pct"),
    ("early guess %", "early_guess_pct", "pct"), ("distractor answer %", "distractor_answer_pct", "pct"),
    ("first distractor %", "first_distractor_pct", "pct"), ("copied over evidence %", "copied_over_pct", "pct"),
    *((OUTCOME_LABELS[k], k, "count") for k in OUTCOMES),
    ("memory tokens", "memory_tokens_mean", "num"), ("cap hit %", "cap_hit_pct", "pct"),
    ("4-gram repeat %", "repeat_4gram_pct", "pct"), ("empty %", "empty_memory_pct", "pct"),
    ("unchanged %", "unchanged_memory_pct", "pct"),
    ("correct by distractors before", "correct_by_distractors_before", "split"),
)


def diagnostics_cells(cell: CellDiagnostics | None) -> list[str]:
    """The diagnostics table's cells for one (method, task, length); ``n/a`` where nothing was measured."""
    out = []
    for _, key, kind in DIAG_COLUMNS:
        if cell is None:
            out.append("n/a")
        elif kind == "count":
            out.append(str(cell.outcomes.get(key, 0)))
        else:
            v = getattr(cell, key)
            if kind == "split":
                out.append(format_split(v) or "n/a")
                continue
            out.append("n/a" if v is None else f"{v:.1f}" if kind == "pct" else f"{v:.0f}")
    return out


def diagnostics_markdown(rows: Sequence[tuple[str, Any, CellDiagnostics | None]]) -> str:
    """A Markdown table, one line per ``(series label, CellSummary, CellDiagnostics)``; lengths with their unit
    (``2K tok``, ``50 docs``)."""
    heads = ["method", "task", "length", "n", "score %"] + [h for h, _, _ in DIAG_COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for label, c, d in rows:
        lines.append("| " + " | ".join([label, c.task, length_with_unit(c.length, c.length_unit), str(c.n), f"{100 * c.mean:.1f}"]
                                         + diagnostics_cells(d)) + " |")
    return "\n".join(lines) + "\n"


def word_diff(old: str, new: str) -> list[tuple[str, str]]:
    """A word-level diff of two memories (``difflib.SequenceMatcher`` over words and the whitespace runs between
    them, whitespace never an anchor of a match, so a word is kept even when the space after it changed):
    ``[(op, text), ...]`` with ``op`` ``=`` (kept), ``+`` (added) or ``-``
    (removed). Joining the ``=`` and ``+`` texts gives ``new`` back; ``=`` and ``-`` give ``old``."""
    a, b = re.findall(r"\S+|\s+", old), re.findall(r"\S+|\s+", new)
    out: list[tuple[str, str]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(str.isspace, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            out.append(("=", "".join(b[j1:j2])))
            continue
        if i2 > i1:
            out.append(("-", "".join(a[i1:i2])))
        if j2 > j1:
            out.append(("+", "".join(b[j1:j2])))
    return out


def timeline(turns: Sequence[Mapping[str, Any]], targets: Sequence[TargetStatus]) -> list[dict[str, Any]]:
    """One entry per update turn: chunk index and ranges, tokens, finish reason, the memory's word diff against
    the previous memory (``[[op, text], ...]``, see :func:`word_diff`), the targets
    whose evidence this chunk holds and the targets the memory holds."""
    out, prev = [], ""
    for t in turns:
        if t.get("kind") != "update":
            continue
        mem = t.get("memory") or ""
        k = t.get("chunk_index")
        out.append({
            "chunk": k, "chars": t.get("chunk_chars"), "context_chars": t.get("context_chars"),
            "tokens": t.get("completion_tokens"), "finish": t.get("finish_reason"),
            "diff": [list(x) for x in word_diff(prev, mem)],
            "evidence": [s.label for s in targets if k in s.evidence_chunks],
            "holds": [s.label for s in targets if s.found_in(mem)],
        })
        prev = mem
    return out


def sample_record(run: str, row: Mapping[str, Any], d: SampleDiagnosis, turns: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """The JSON the page renders for one sample."""
    return {
        "run": run, "method": d.method, "task": d.task, "length": d.length, "sample_id": d.sample_id, "kind": d.kind,
        "outcome": d.outcome, "note": d.note, "score": d.score, "lost_at": d.lost_at,
        "early_guess": d.early_guess,
        "distractor_answer": d.distractor_answer,
        "first_distractor_answer": d.first_distractor_answer,
        "distractors_before": d.distractors_before,
        "copied_over": d.copied_over,
        "question": row.get("question", ""), "gold": list(row.get("answers") or []), "answer": row.get("answer", ""),
        "response": row.get("response", ""), "error": row.get("error"),
        "targets": [t.to_dict() for t in d.targets],
        "timeline": timeline(turns, d.targets) if turns is not None else None,
    }


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _diag_table(cells: Sequence[tuple[str, Any, CellDiagnostics | None]]) -> str:
    """The diagnostics table; each non-zero outcome count links to the sample list filtered to that cell and
    class (``#outcome=...&cell=...``); lengths with their unit (``2K tok``, ``50 docs``)."""
    heads = ["method", "task", "length", "n", "score %"] + [h for h, _, _ in DIAG_COLUMNS]
    body = []
    for lab, c, d in cells:
        tds = [_esc(x) for x in (lab, c.task, length_with_unit(c.length, c.length_unit), c.n,
                                 f"{100 * c.mean:.1f} ± {100 * c.stderr:.1f}")]
        cell_key = f"{lab}|{c.task}|{c.length}"
        for (_, key, kind), text in zip(DIAG_COLUMNS, diagnostics_cells(d)):
            if kind == "count" and text not in ("0", "n/a"):
                q = html.escape(f"outcome={key}&cell={_url(cell_key)}", quote=True)
                tds.append(f"<a href='#{q}' class='count'>{_esc(text)}</a>")
            else:
                tds.append(_esc(text))
        body.append("<tr>" + "".join(f"<td>{t}</td>" for t in tds) + "</tr>")
    th = "".join(f"<th>{_esc(h)}</th>" for h in heads)
    return f"<table class='grid'><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _url(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def embedded_json(value: Any) -> str:
    """``value`` as JSON text safe inside a ``<script>`` element: every ``<``, ``>`` and ``&`` is written as its
    ``\\u003c``, ``\\u003e``, ``\\u0026`` escape (they occur only inside JSON strings), so no document text (``</script>``,
    ``<!--``, ``<script``) can end the element early or change how the HTML parser reads it; ``json.loads`` (or
    ``JSON.parse``) of the text gives ``value`` back."""
    data = json.dumps(value, ensure_ascii=False)
    return data.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render_page(title: str, provenance: Sequence[str], png: bytes | None,
                cells: Sequence[tuple[str, Any, CellDiagnostics | None]], samples: Sequence[Mapping[str, Any]]) -> str:
    """The whole page as one string (see the module docstring).

    Args:
        title: the page title.
        provenance: one line per run (backend, tokenizer, seed, ...), plain text.
        png: the accuracy plot as PNG bytes, or ``None``.
        cells: ``(series label, CellSummary, CellDiagnostics or None)`` per cell.
        samples: :func:`sample_record` dicts.
    """
    plot = (f"<img alt='accuracy against length' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            if png else "<p>(no plot)</p>")
    data = embedded_json({"samples": list(samples), "labels": OUTCOME_LABELS, "order": list(OUTCOMES)})
    prov = "".join(f"<li>{_esc(p)}</li>" for p in provenance)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{_esc(title)}</h1><ul class="prov">{prov}</ul>
<h2>Accuracy against length</h2><div class="plot">{plot}</div>
<h2>Diagnostics per cell</h2>
<p class="help">read: the evidence lies in what the method saw (after truncation). captured: the memory written
after the evidence chunk holds the answer; retained: the final memory holds it (both over the memory-agent samples
whose evidence was read and traced). early guess: the wrong answer repeats a number the memory already held
before the evidence chunk. distractor answer: the wrong answer names another number of the document (on RULER's
needle tasks, another key's value); first distractor: it names the document's first such number (the first needle
read was another key's, and the answer kept it). Outcome columns count samples. Memory health is per update. n/a: not
measured (no trace, no evidence positions, or the answer is not stated literally). A count lists its samples
below. Definitions: docs/diagnostics.md.</p>
{_diag_table(cells)}
<h2 id="samples">Samples</h2>
<div id="filters"></div>
<div class="cols"><div id="sample-list"></div><div id="sample-view"><p class="help">Pick a sample: its view opens on the right.</p></div></div>
<script id="report-data" type="application/json">{data}</script>
<script>{_JS}</script>
</body></html>
"""


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.4em}
.prov{font-size:12px;color:#555}.help{font-size:12px;color:#555;max-width:70em}
.plot img{max-width:100%;max-height:360px}
table.grid{border-collapse:collapse;font-size:12px}
table.grid td,table.grid th{border:1px solid #ccc;padding:2px 5px;text-align:right}
table.grid td{white-space:nowrap}
table.grid td:first-child,table.grid td:nth-child(2){text-align:left}
.cols{display:flex;gap:1em;align-items:flex-start}
#sample-list{width:34%;max-height:80vh;overflow:auto;font-size:12px}
#sample-view{flex:1;min-width:0}
#sample-view.open{position:fixed;top:0;right:0;width:62%;height:100vh;overflow:auto;background:#fff;
 border-left:2px solid #888;box-shadow:-4px 0 12px rgba(0,0,0,.15);padding:.2em 1em;box-sizing:border-box}
#sample-view .close{float:right;font-size:13px}
#sample-list a{display:block;padding:2px 4px;color:#222;text-decoration:none;border-bottom:1px solid #eee}
#sample-list a.sel{background:#e8f0ff}
.badge{display:inline-block;padding:0 5px;border-radius:3px;font-size:11px;color:#fff;margin-right:4px}
.o-correct{background:#2a8f3c}.o-retained_wrong{background:#b5651d}.o-captured_then_lost{background:#c0392b}
.o-never_captured{background:#7d3c98}.o-not_read{background:#555}.o-in_view_wrong{background:#b5651d}
.o-unmeasured{background:#999}.o-error{background:#000}
#filters button{margin:0 4px 6px 0;font-size:12px}#filters button.on{outline:2px solid #36f}
.tl{border-collapse:collapse;width:100%;font-size:12px}
.tl td{border-top:1px solid #ddd;vertical-align:top;padding:3px}
.tl tr.evidence{background:#fff6d6}.mem{white-space:pre-wrap;word-break:break-word}
ins{background:#c8f0c8;text-decoration:none}del{background:#f6c8c8}
.chip{display:inline-block;border:1px solid #999;border-radius:8px;padding:0 5px;margin:1px;font-size:11px}
.chip.ev{border-color:#d4a017;background:#fff0b3}.chip.ok{border-color:#2a8f3c}
pre.box{white-space:pre-wrap;background:#f6f6f6;padding:4px;max-height:12em;overflow:auto}
"""

_JS = r"""
(function(){
const D = JSON.parse(document.getElementById('report-data').textContent);
const S = D.samples, L = D.labels;
const esc = s => String(s == null ? '' : s).replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));
const badge = o => `<span class="badge o-${o}">${esc(L[o] || o)}</span>`;
let filter = null, cellFilter = null;
const cellOf = s => `${s.run ? s.run + '/' : ''}${s.method}|${s.task}|${s.length}`;
const shown = s => (!filter || s.outcome === filter) && (!cellFilter || cellOf(s) === cellFilter);
function params(){ const h = new URLSearchParams(location.hash.slice(1)); return {sample: h.get('sample'), outcome: h.get('outcome'), cell: h.get('cell')}; }
function drawFilters(){
  const counts = {}, inCell = S.filter(s => !cellFilter || cellOf(s) === cellFilter);
  inCell.forEach(s => counts[s.outcome] = (counts[s.outcome] || 0) + 1);
  let h = `<button data-o="" class="${filter ? '' : 'on'}">all (${inCell.length})</button>`;
  if (cellFilter) h = `<button data-cell="1" class="on" title="show every cell">cell ${esc(cellFilter.replaceAll('|', ' · '))} ×</button>` + h;
  D.order.filter(o => counts[o]).forEach(o => { h += `<button data-o="${o}" class="${filter === o ? 'on' : ''}">${esc(L[o])} (${counts[o]})</button>`; });
  const f = document.getElementById('filters'); f.innerHTML = h;
  f.querySelectorAll('button').forEach(b => b.onclick = () => {
    if (b.dataset.cell) cellFilter = null; else filter = b.dataset.o || null;
    drawFilters(); drawList(params().sample); });
}
function drawList(sel){
  let h = '';
  S.forEach((s, i) => { if (!shown(s)) return;
    h += `<a href="#sample=${i}" id="item-${i}" class="${String(i) === sel ? 'sel' : ''}">${badge(s.outcome)}${esc(s.run ? s.run + '/' : '')}${esc(s.method)} · ${esc(s.task)} ${esc(s.length)} · ${esc(s.sample_id)} · score ${s.score.toFixed(2)}</a>`; });
  document.getElementById('sample-list').innerHTML = h || '<p class="help">no sample in this class</p>';
}
function diffHtml(ops){ return ops.map(([op, t]) => op === '+' ? `<ins>${esc(t)}</ins>` : op === '-' ? `<del>${esc(t)}</del>` : esc(t)).join(''); }
function targetsHtml(s){
  if (!s.targets.length) return '';
  const row = t => `<tr><td>${esc(t.label)}</td><td>${t.read == null ? 'n/a' : t.read ? 'yes' : 'no (cut by truncation)'}</td><td>${esc((t.evidence_chunks || []).join(', '))}</td><td>${t.captured == null ? 'n/a' : t.captured ? 'yes, at chunk ' + t.captured_at : 'no'}</td><td>${t.retained == null ? 'n/a' : t.retained ? 'yes' : 'no'}${t.lost_at != null ? ' (dropped at update ' + t.lost_at + ')' : ''}</td></tr>`;
  return `<table class="grid"><thead><tr><th>target</th><th>read</th><th>evidence chunk</th><th>captured</th><th>retained</th></tr></thead><tbody>${s.targets.map(row).join('')}</tbody></table>`;
}
function timelineHtml(s){
  if (s.kind !== 'memory_agent') return '';
  if (!s.timeline) return '<p class="help">No trace for this row: the memory timeline is not available.</p>';
  let h = '<h4>Memory after each update</h4><table class="tl"><tbody>';
  s.timeline.forEach(u => {
    const ev = u.evidence.map(l => `<span class="chip ev">★ evidence: ${esc(l)}</span>`).join('');
    const holds = u.holds.map(l => `<span class="chip ok">holds ${esc(l)}</span>`).join('');
    h += `<tr class="${u.evidence.length ? 'evidence' : ''}" data-chunk="${u.chunk}"><td>chunk ${u.chunk}<br><small>chars ${esc(JSON.stringify(u.chars))}</small><br><small>${esc(u.tokens)} tok${u.finish === 'length' ? ', <b>hit cap</b>' : ''}</small></td><td>${ev}${holds}<div class="mem">${diffHtml(u.diff)}</div></td></tr>`; });
  return h + '</tbody></table>';
}
function drawView(i){
  const v = document.getElementById('sample-view'), s = S[i];
  if (!s) { v.className = ''; v.innerHTML = '<p class="help">Pick a sample.</p>'; return; }
  v.className = 'open';
  const flags = (s.outcome === 'captured_then_lost' && s.lost_at != null ? ` (dropped at update ${s.lost_at})` : '')
    + (s.early_guess ? ' (early guess: the answer repeats a number held before the evidence)' : '')
    + (s.copied_over ? ' (copied over: the update of the evidence chunk returned the previous memory unchanged)' : '')
    + (s.first_distractor_answer ? ' (first distractor: the first number of its kind in the document)'
       : s.distractor_answer ? ' (distractor answer: another number of the document)' : '')
    + (s.distractors_before ? ` (${s.distractors_before} other value${s.distractors_before > 1 ? 's' : ''} of its kind before the gold)` : '');
  v.innerHTML = `<div id="sample-detail" data-sample-id="${esc(s.sample_id)}" data-outcome="${esc(s.outcome)}">
  <a class="close" href="#">× close</a><h3>${badge(s.outcome)}${esc(s.method)} · ${esc(s.task)} ${esc(s.length)} · ${esc(s.sample_id)}${flags}</h3>
  ${s.note ? `<p class="help">${esc(s.note)}</p>` : ''}
  <p><b>Question</b></p><pre class="box">${esc(s.question)}</pre>
  <p><b>Gold</b>: ${esc(s.gold.join(' | '))} &nbsp; <b>Answer</b>: ${esc(s.answer)} &nbsp; <b>score</b> ${s.score.toFixed(2)}</p>
  ${s.error ? `<p><b>Error</b>: ${esc(s.error)}</p>` : ''}
  ${targetsHtml(s)}${timelineHtml(s)}
  <p><b>Final response</b></p><pre class="box">${esc(s.response)}</pre></div>`;
}
function route(){
  const p = params();
  if (p.outcome !== null) { filter = p.outcome || null; cellFilter = p.cell || null; }
  drawFilters(); drawList(p.sample); drawView(p.sample == null ? -1 : Number(p.sample));
}
window.addEventListener('hashchange', route);
route();
})();
"""


def write_html(path, provenance: Sequence[str], png: bytes | None, cells, diagnosis) -> None:
    """Write ``report.html``: :func:`render_page` over every row of the runs of ``diagnosis`` (a
    :class:`memagent.eval.run_diagnostics.RunsDiagnosis`), their traces read again for the timelines."""
    from memagent.runfiles import read_trace

    samples = []
    multi = len(diagnosis.runs) > 1
    for label, run, rows, diags in diagnosis.runs:
        traces: dict[str, dict] = {}
        for row, d in sorted(zip(rows, diags), key=lambda x: (x[1].task, x[1].length, x[1].method, _sid_key(x[1].sample_id))):
            turns = None
            if d.kind == "memory_agent" and row.get("trace"):
                if row["trace"] not in traces:
                    traces[row["trace"]] = read_trace(run / row["trace"])
                turns = traces[row["trace"]].get(d.sample_id)
            samples.append(sample_record(label if multi else "", row, d, turns))
    title = "memagent report: " + ", ".join(label for label, *_ in diagnosis.runs)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_page(title, provenance, png, cells, samples))


def _sid_key(sid: str) -> tuple:
    """Sample ids in natural order (``x-2`` before ``x-10``)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", sid))

"""Run-folder files, in one place: result and prediction rows (one schema), traces, manifests, locks,
torn-line repair, and the one rule for what a resume may change.

The agent, evaluation, training and the command line read and write these files only through this package:

- :mod:`.jsonl`: JSON-lines files that survive a kill (a torn last line is cut or ignored, rewrites are atomic);
- :mod:`.rows`: the row schema of ``memagent run`` predictions and ``memagent eval`` results, ``results.jsonl``;
- :mod:`.predictions`: ``memagent run --resume`` (done samples, the settings check);
- :mod:`.trace`: per-turn traces (written, pruned for a resume, read back);
- :mod:`.manifest`: ``manifest.json`` with provenance, and the run folder's lock;
- :mod:`.resume`: what a resumed run may change;
- :mod:`.outputs`: the output files of ``memagent run`` and ``demo``, checked before any model loads.
"""

from memagent.runfiles.jsonl import JsonlWriter, append_rows, complete_lines, keep_lines, parse_line, repair_tail, rewrite
from memagent.runfiles.manifest import (FolderLock, first_missing, folder_problem, git_commit, output_lock, package_version,
                                       read_manifest, remove_created, run_lock, unwritable, write_json, write_manifest)
from memagent.runfiles.predictions import finished_ids, input_sha256, resume_predictions
from memagent.runfiles.resume import describe, setting_changes, settings_hash
from memagent.runfiles.rows import (
    NOT_RUN,
    OPTIONAL_ROW_FIELDS,
    ROW_FIELDS,
    Outcome,
    ResultWriter,
    check_row,
    read_results,
    result_row,
    row_key,
    row_sample_id,
)
from memagent.runfiles.trace import check_trace_file, prune_trace, read_trace, trace_rows, write_trace

__all__ = [
    "FolderLock", "NOT_RUN", "OPTIONAL_ROW_FIELDS", "ROW_FIELDS", "JsonlWriter", "Outcome", "ResultWriter", "append_rows", "check_row", "check_trace_file",
    "complete_lines", "describe", "finished_ids", "first_missing", "input_sha256", "folder_problem", "git_commit", "keep_lines", "package_version", "parse_line",
    "prune_trace", "read_manifest", "read_results", "read_trace", "remove_created", "repair_tail", "result_row", "resume_predictions", "rewrite",
    "output_lock", "row_key", "row_sample_id", "run_lock", "setting_changes", "settings_hash", "trace_rows", "unwritable", "write_json",
    "write_manifest", "write_trace",
]

import pytest

from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates
from memagent.answers import extract_answer, last_boxed, strip_reasoning
from memagent.errors import ConfigError


@pytest.mark.parametrize(
    "text, answer, method",
    [
        (r"so \boxed{Paris}", "Paris", "boxed"),
        (r"\boxed{a} then \boxed{b}", "b", "boxed"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", "boxed"),
        (r"\boxed{\text{Oslo}}", "Oslo", "boxed"),
        (r"\fbox{x}", "x", "boxed"),
        (r"\boxed 42$ rest", "42", "boxed"),
        (r"<think>\boxed{wrong}</think>The answer is Rome.", "Rome", "answer_is"),
        ("Therefore, the answer is: **Bern**.", "Bern", "answer_is"),
        ("THE ANSWER IS lima\nmore text", "lima", "answer_is"),
        (r"cut off \boxed{Par", r"cut off \boxed{Par", "raw"),
        ("  just words  ", "just words", "raw"),
        ("<think>never closed", "", "empty"),
        ("", "", "empty"),
    ],
)
def test_extract_answer(text, answer, method):
    got = extract_answer(text)
    assert (got.answer, got.method) == (answer, method)


def test_last_boxed_and_strip_reasoning():
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{{}}") == "{}"
    assert strip_reasoning("a<think>b</think>c<think>d</think>e") == "e"


def test_slots_filled_in_one_pass():
    t = PromptTemplates(update="Q={question} M={memory} C={chunk}", final="Q={question} M={memory}", no_memory="none")
    assert t.render_update("{memory}", "{chunk}", "{question}") == "Q={memory} M={chunk} C={question}"
    assert t.render_final("q", "") == "Q=q M=none"
    assert [m.role for m in t.messages_final("q", "m")] == ["user"]
    ts = PromptTemplates(update=t.update, final=t.final, system="sys")
    assert [(m.role, m.content) for m in ts.messages_final("q", "m")] == [("system", "sys"), ("user", "Q=q M=m")]


def test_default_templates_structure_and_hash():
    u = DEFAULT_TEMPLATES.render_update("QQ", None, "CC")
    assert u.endswith("<problem>\nQQ\n</problem>\n\n<memory>\nNo previous memory\n</memory>\n\n<section>\nCC\n</section>\n\nUpdated memory:")
    f = DEFAULT_TEMPLATES.render_final("QQ", "MM")
    assert "\\boxed{}" in f and f.endswith("<problem>\nQQ\n</problem>\n\n<memory>\nMM\n</memory>\n\nYour answer:")
    assert DEFAULT_TEMPLATES.hash == "1378d386897b"  # golden: changes whenever the wording changes


def test_a_template_given_twice_in_a_file_is_refused(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("update: 'U {problem} {memory} {chunk}'\nfinal: 'F {problem} {memory}'\nupdate: 'U2 {chunk}'\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: line 3: the key 'update' is given a second time "
                                          r"\(first at line 1\)"):
        PromptTemplates.from_file(p)  # the first update template was dropped silently


def test_templates_from_file_and_errors(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("update: '{question}|{memory}|{chunk}'\nfinal: '{question}|{memory}'\nno_memory: '-'\n")
    t = PromptTemplates.from_file(p)
    assert t.render_update("a", "", "c") == "a|-|c" and t.hash != DEFAULT_TEMPLATES.hash
    p.write_text("update: '{question}|{memory}'\nfinal: '{question}|{memory}'\n")
    with pytest.raises(ConfigError, match=r"lacks the slot\(s\) \{chunk\}"):
        PromptTemplates.from_file(p)
    p.write_text("update: '{question}{memory}{chunk}'\nfinal: '{question}{memory}{chunk}'\n")
    with pytest.raises(ConfigError, match="must not contain"):
        PromptTemplates.from_file(p)
    p.write_text("update: '{question}{memory}{chunk} again: {chunk}'\nfinal: '{question}{memory}{question}'\n")
    with pytest.raises(ConfigError, match=r"the update template holds \{chunk\} more than once; each slot may appear once"):
        PromptTemplates.from_file(p)
    p.write_text("update: '{question}{memory}{chunk}'\nfinal: '{question}{memory}{question}'\n")
    with pytest.raises(ConfigError, match=r"the final template holds \{question\} more than once"):
        PromptTemplates.from_file(p)
    p.write_text("update: [1, 2]\nfinal: '{question}{memory}'\n")
    with pytest.raises(ConfigError, match="field 'update' must be text, got list"):
        PromptTemplates.from_file(p)
    p.write_text("final: x\n")
    with pytest.raises(ConfigError, match="need the keys"):
        PromptTemplates.from_file(p)
    with pytest.raises(ConfigError, match="cannot read"):
        PromptTemplates.from_file(tmp_path / "missing.yaml")


def test_builtin_chunk_first_templates():
    from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates

    t = PromptTemplates.from_file("chunk_first")
    assert PromptTemplates.from_file("default") == DEFAULT_TEMPLATES
    text = t.render_update("Q?", "MEM", "CHUNK")
    assert text.index("<problem>") < text.index("CHUNK") < text.index("MEM")
    # two memories over the same chunk share everything before the memory
    a, b = t.render_update("Q?", "MEMONE", "CHUNK"), t.render_update("Q?", "MEMTWO", "CHUNK")
    assert a[: a.index("MEMONE")] == b[: b.index("MEMTWO")] and len(a[: a.index("MEMONE")]) > len(t.update) // 2
    assert t.final == DEFAULT_TEMPLATES.final and t.hash != DEFAULT_TEMPLATES.hash

@pytest.mark.parametrize(
    "text, answer",
    [
        # Qwen2.5-Instruct's markdown labels
        ("**Answer:** Paris", "Paris"),
        ("**Answer**: Paris", "Paris"),
        ("Based on the notes:\n\n**Final Answer:** Paris.", "Paris"),
        ("### Final Answer\n\nParis", "Paris"),
        ("Reasoning first.\n**Final Answer**\n**Paris**", "Paris"),
        # plain labels
        ("Answer: Paris", "Paris"),
        ("Final answer: 1945", "1945"),
        ("Your answer: yes", "yes"),
        ("The answer: no.", "no"),
        ("> answer : Nile", "Nile"),
        # SmolLM2-135M-Instruct, from docs/results/embedded and a short run of the embedded model
        ('The answer to this question is: "Hamlet"', "Hamlet"),
        ("The answer to the question is 1.\n\nThe document provides a detailed description.", "1"),
        ("The answer to this question is:\n\nYes, they are both American.", "Yes, they are both American"),
        ('- Answer: The answer is "S/S"', "S/S"),
        ("The answer is Rome.\nYour answer is:", "Rome"),  # the last label is empty: the one before it
        ("...and the final answer is:\n\nThe final answer is:\n\nMaid Marian.", "Maid Marian"),  # SmolLM2
        ('- Answer: The answer is "S/S"\n- Answer: The document contains the following:', "S/S"),  # a lead-in
    ],
)
def test_answer_labels_small_instruct_models_write(text, answer):
    got = extract_answer(text)
    assert (got.answer, got.method) == (answer, "answer_is")


@pytest.mark.parametrize("text", ["Answer the question from the notes: Paris", "Your answer is:",
                                  "The answer is:\n\nThe answer is:\n\nThe answer is:",  # SmolLM2 repeating itself
                                  "The answers differ by source.", "My reply: Paris"])
def test_text_that_only_mentions_an_answer_stays_raw(text):
    assert extract_answer(text).method == "raw"


def test_boxed_text_parts_and_literal_braces():
    """Each \\text{...} of a box is unwrapped with its braces matched (a greedy pattern returned 'New} \\text{York'),
    and LaTeX's literal braces \\{ \\} do not close the box."""
    from memagent.answers import extract_answer
    from memagent.scoring import score

    cases = {r"\boxed{\text{New} \text{York}}": "New York", r"\boxed{\text{A}, \text{B}}": "A, B",
             r"\boxed{\text{Paris}}": "Paris", r"\boxed{\textbf{a {b} c}}": "a {b} c", r"\boxed{\}}": r"\}",
             r"\boxed{\{1, 2\}}": r"\{1, 2\}", r"\boxed{\frac{1}{2}}": r"\frac{1}{2}", r"\boxed{\mathrm{kg}} m": "kg"}
    for text, answer in cases.items():
        assert (extract_answer(text).answer, extract_answer(text).method) == (answer, "boxed"), text
    assert score("exact_match", r"\boxed{\text{New} \text{York}}", ["New York"]) == 1.0
    assert extract_answer(r"\boxed{\text{cut off").method == "raw"  # never closed: not a box


def test_every_styling_wrapper_in_a_box_is_unwrapped_nested_too():
    """\\textit, \\emph, \\mathbf ... only style their text: \\boxed{\\mathbf{42}} is 42. Only \\text, \\textbf and
    \\mathrm were unwrapped, so these normalised to "mathbf42" or "textitparis" and scored 0 in EM, F1 and the strict
    reward; a nested wrapper kept the inner one."""
    from memagent.answers import extract_answer, unwrap_text
    from memagent.scoring import score

    cases = {r"\boxed{\textit{Paris}}": "Paris", r"\boxed{\emph{Paris}}": "Paris", r"\boxed{\mathbf{42}}": "42",
             r"\boxed{\texttt{x}\textsf{y}}": "xy", r"\boxed{\mbox{New York}}": "New York",
             r"\boxed{\text{\textbf{Paris}}}": "Paris", r"\boxed{\textbf{\text{New} York}}": "New York",
             r"\boxed{\operatorname{sin}}": r"\operatorname{sin}"}
    for text, answer in cases.items():
        assert extract_answer(text).answer == answer, text
    assert unwrap_text(r"\text{a} \textbf{cut \text{off}") == r"a \textbf{cut \text{off}"  # an unclosed one stays
    assert score("exact_match", r"\boxed{\mathbf{42}}", ["42"]) == 1.0
    assert score("strict_boxed", r"\boxed{\textit{Paris}}", ["Paris"]) == 1.0
    assert score("f1", r"\boxed{\emph{New York}}", ["new york"]) == 1.0


def test_an_answer_after_a_label_in_latex_style_is_unwrapped_as_a_box_is():
    """``Answer: $\\text{Paris}$`` is Paris, as ``\\boxed{\\text{Paris}}`` is: the label's answer kept the wrapper,
    normalised to "textparis" and scored 0 in EM and F1."""
    from memagent.answers import extract_answer
    from memagent.scoring import score

    assert (extract_answer(r"Answer: $\text{Paris}$").answer, extract_answer(r"**Answer:** \textbf{Paris}.").answer,
            extract_answer(r"The answer is \(\text{New York}\).").answer) == ("$Paris$", "Paris", r"\(New York\)")
    assert extract_answer(r"The answer is \textbf{Paris}.").method == "answer_is"
    assert score("exact_match", r"Answer: $\text{Paris}$", ["Paris"]) == 1.0
    assert score("f1", r"The answer is \(\text{New York}\).", ["New York"]) == 1.0

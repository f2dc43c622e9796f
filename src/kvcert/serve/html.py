"""A self-contained HTML view of one `Generation`: the answer's tokens coloured by certificate, each with a hover card
(certificate, log-probability, trust, per-layer values), the escalations where they happened, a legend, and the
memory the compressed cache held beside the full cache's.

    from kvcert.serve.html import write_html
    write_html(out, "answer.html", question="Who wrote it?")

One file, inline CSS only: no scripts, fonts, images or network requests, so it opens anywhere (and is safe to mail).
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from kvcert.serve.generation import Generation, draws_phrase, policy_words
from kvcert.serve.stream import Escalated, Token

LAYERS_PER_LINE = 5  # per-layer values in the hover card, this many to a line

_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d1d1f; margin: 24px auto;
       max-width: 1100px; padding: 0 16px; }
h1 { font-size: 20px; margin: 0 0 12px; }
h2 { font-size: 15px; margin: 22px 0 6px; color: #555; text-transform: uppercase; letter-spacing: .04em; }
.question { background: #f4f4f6; border-left: 4px solid #8a8fa0; padding: 8px 12px; white-space: pre-wrap; }
.answer { font: 17px/2.1 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; padding: 10px 12px;
          border: 1px solid #ddd; border-radius: 6px; white-space: pre-wrap; word-break: break-word; }
.tok { position: relative; padding: 2px 1px; margin: 0 1px; border-radius: 3px; cursor: default; }
.tok.untrusted { text-decoration: underline dotted #b00020 2px; text-underline-offset: 4px; }
.tok.full { outline: 2px solid #2456c8; outline-offset: -1px; }
.tok.exact { box-shadow: inset 0 -3px 0 #1b7f3b; }
.tok.none { background: #e3e3e3; color: #555; }
.tok .empty { color: #999; }
.tok:hover::after, .tok:target::after { content: attr(data-tip); position: absolute; left: 0; top: 1.9em; z-index: 10;
                    background: #1d1d1f; color: #fff; font: 12px/1.45 ui-monospace, Menlo, Consolas, monospace;
                    padding: 6px 9px; border-radius: 5px; white-space: pre; box-shadow: 0 2px 8px #0004; }
.esc { position: relative; background: #2456c8; color: #fff; font: bold 12px/1 system-ui, sans-serif;
       padding: 3px 6px; border-radius: 10px; margin: 0 3px; cursor: default; }
.esc:hover::after { content: attr(data-tip); position: absolute; left: 0; top: 2em; z-index: 10; background: #1d1d1f;
                    color: #fff; font: 12px/1.45 ui-monospace, Menlo, monospace; padding: 6px 9px; border-radius: 5px;
                    white-space: pre; }
.summary { font: 13px/1.5 ui-monospace, Menlo, Consolas, monospace; background: #f4f4f6; padding: 8px 12px;
           border-radius: 6px; white-space: pre-wrap; }
.memory { display: flex; align-items: center; gap: 12px; margin: 8px 0; font-size: 14px; }
.bar { width: 360px; height: 14px; background: #dde3f0; border-radius: 7px; overflow: hidden; }
.bar > i { display: block; height: 100%; background: #2456c8; }
.legend { display: flex; flex-wrap: wrap; gap: 8px 22px; align-items: center; font-size: 13px; }
.scale { display: inline-block; width: 180px; height: 12px; border-radius: 6px; vertical-align: middle;
         background: linear-gradient(90deg, hsl(120,65%,78%), hsl(60,65%,78%), hsl(0,65%,78%)); }
table { border-collapse: collapse; font: 12px/1.4 ui-monospace, Menlo, monospace; margin-top: 6px; }
td, th { border-bottom: 1px solid #eee; padding: 2px 10px; text-align: right; }
td.text { text-align: left; white-space: pre; }
.meta { color: #666; font-size: 13px; }
"""


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if math.isfinite(value) else "n/a"


def _colour(cert: float, top: float) -> str | None:
    """Background for a certificate: a linear green -> yellow -> red scale from 0 to `top` (red at or above it);
    None where there is no certificate."""
    if not math.isfinite(cert):
        return None
    t = min(max(cert / top, 0.0), 1.0) if top > 0 else 0.0
    return f"hsl({120 * (1 - t):.0f},65%,78%)"


def _layer_lines(layers: list[float]) -> list[str]:
    cells = [f"L{i}: {v:.3g}" for i, v in enumerate(layers) if math.isfinite(v)]
    if not cells:
        return ["layers: none compressed at this step"]
    lines = ["per layer (largest head):"]
    for start in range(0, len(cells), LAYERS_PER_LINE):
        lines.append("  " + "  ".join(f"{c:<12}" for c in cells[start : start + LAYERS_PER_LINE]).rstrip())
    return lines


def _kind(tok: Token) -> str:
    """What produced the token: the full cache, the exact read of the prompt, or the compressed cache."""
    if tok.budget >= 1.0:
        return "full"
    if tok.certificate == 0.0 and tok.trusted:
        return "exact"
    return "compressed"


def _tip(tok: Token, reduction: str) -> str:
    kind = _kind(tok)
    lines = [
        f"token {tok.index}  {tok.text!r}  (id {tok.id})",
        f"certificate {_fmt(tok.certificate)}  ({reduction} over layers and heads, relative radius at 0.95)",
        f"log-probability {tok.logprob:.3f}  (p = {math.exp(tok.logprob):.3f})",
        f"trusted: {'yes' if tok.trusted else 'no'}",
        f"cache: budget {tok.budget:g}"
        + {"full": " (full cache: exact)", "exact": " (read exactly with the prompt)", "compressed": ""}[kind],
    ]
    if kind == "compressed":
        lines += _layer_lines(tok.layers)
    return "\n".join(lines)


def _token_span(tok: Token, top: float, reduction: str) -> str:
    kind = _kind(tok)
    classes = ["tok"]
    if not tok.trusted:
        classes.append("untrusted")
    if kind != "compressed":
        classes.append(kind)
    colour = _colour(tok.certificate, top)
    if colour is None:
        classes.append("none")
    style = f' style="background:{colour}"' if colour else ""
    # a token that decodes to nothing (a special token) still gets a visible placeholder
    text = escape(tok.text) if tok.text else '<i class="empty">&#8709;</i>'
    tip = escape(_tip(tok, reduction), quote=True).replace("\n", "&#10;")
    # id: page.html#t5 opens with token 5's card shown (:target), a link to one token without any script
    return f'<span class="{" ".join(classes)}" id="t{tok.index}" data-tip="{tip}"{style}>{text}</span>'


def _escalation_mark(esc: Escalated) -> str:
    to = "the full cache" if esc.budget_to >= 1.0 else f"budget {esc.budget_to:g}"
    if esc.scope == "answer":  # a restart: the answer below is the larger budget's own, from its first token
        first = f"answer restarted: {esc.discarded} token(s) written at budget {esc.budget_from:g} discarded"
        read = f"re-read {esc.reread_tokens} tokens (the prompt)"
    else:
        first = f"escalation before token {esc.token}"
        read = f"re-read {esc.reread_tokens} tokens (prompt + answer so far)"
    tip = "\n".join([first, f"reason: {esc.reason}", f"budget {esc.budget_from:g} -> {esc.budget_to:g}", read])
    tip = escape(tip, quote=True).replace("\n", "&#10;")
    return f'<mark class="esc" data-tip="{tip}">&#8635; {escape(to)}</mark>'


def escalation_threshold(gen: Generation) -> tuple[float | None, str | None]:
    """The certificate threshold the generation's escalation rule used (the calibration's for its rate at the
    policy's budget, or the one given), with its legend label; (None, None) when no certificate rule applied."""
    esc = gen.escalation
    if esc is None or esc.signal != "certificate" or gen.threshold is None:
        return None, None
    if gen.escalator is not None:
        return gen.threshold, f"the rate escalator's threshold for this answer (target {gen.escalator['rate']:g})"
    if esc.threshold is not None:
        return gen.threshold, "the escalation threshold given"
    where = f"at budget {gen.policy.budget:g}"
    return gen.threshold, f"the escalation threshold: the calibration's for escalating {esc.rate:g} of answers {where}"


def _scale_caption(top: float, threshold: float | None, threshold_label: str | None, reference=None) -> str:
    if threshold is not None:
        label = escape(threshold_label or "escalation threshold")
        return f"0 &rarr; {top:.3g} ({label}; red at or above it)"
    ref = "" if reference is None else f"; the calibration's threshold for a 20% escalation rate here: {reference:.3g}"
    return f"0 &rarr; {top:.3g} (this answer's largest certificate; no certificate escalation threshold applied{ref})"


def _draws_line(gen: Generation) -> str:
    """With draws: what they were, the disagreement, and per other draw its largest drop and whether its own greedy
    answer agrees with draw 0's; "" without."""
    if gen.agreement is None or gen.draws is None:
        return ""
    a = gen.agreement
    name = "half" if gen.draws.variant == "split" else "draw"
    rows = "; ".join(
        f"{name} {i if name == 'half' else i + 1}: largest drop {_fmt(d)}, own answer {'differs' if x else 'agrees'}"
        for i, (d, x) in enumerate(zip(a.drops, a.row_differs))
    )
    whose = "the discarded answer's " if gen.restart is not None else ""
    return (
        f'<p class="meta">{escape(whose + draws_phrase(gen.draws, a))} (disagreement: the mean over the other rows '
        f"of the largest drop in log-probability of draw 0's tokens). {escape(rows)}.</p>"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _token_table(gen: Generation) -> str:
    rows = ["<tr><th>#</th><th>text</th><th>certificate</th><th>log-prob</th><th>trusted</th><th>budget</th></tr>"]
    for t in gen.steps:
        rows.append(
            f"<tr><td>{t.index}</td><td class='text'>{escape(repr(t.text))}</td><td>{_fmt(t.certificate)}</td>"
            f"<td>{t.logprob:.3f}</td><td>{'yes' if t.trusted else 'no'}</td><td>{t.budget:g}</td></tr>"
        )
    return "<table>" + "\n".join(rows) + "</table>"


def render_html(
    generation: Generation,
    *,
    title: str | None = None,
    question: str | None = None,
    threshold: float | None = None,
    threshold_label: str | None = None,
) -> str:
    """The page as a string. title: default "kvcert generate: answer from <the cache it came from>". threshold: the
    certificate at which the colour scale turns red; default the one the generation's escalation used
    (`escalation_threshold`); without either the scale runs to the answer's largest certificate."""
    gen = generation
    if title is None:
        title = f"kvcert generate: answer from {gen.source()}"
    if threshold is None:
        threshold, threshold_label = escalation_threshold(gen)
    finite = [c for c in gen.certificate if math.isfinite(c)]
    top = threshold if threshold is not None and threshold > 0 else max(finite, default=0.0)
    marks: dict[int, list[str]] = {}
    for esc in gen.escalations:
        marks.setdefault(esc.token, []).append(_escalation_mark(esc))
    pieces = []
    for tok in gen.steps:
        pieces += marks.pop(tok.index, [])
        pieces.append(_token_span(tok, top, gen.reduction))
    for rest in marks.values():  # an escalation after the last kept token (the answer ended there)
        pieces += rest
    share = gen.kv_bytes / gen.full_kv_bytes if gen.full_kv_bytes else math.nan
    width = 100 * min(share, 1.0) if math.isfinite(share) else 0
    # after an escalation the most held is the larger cache the answer went on with
    held_note = "; the most held, the re-read included" if gen.escalations else ""
    calibrated = escape(gen.calibration) if gen.calibration else "none (every compressed token untrusted)"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<div class="question"><b>Question.</b> {escape(question)}</div>' if question else "",
        "<h2>Answer</h2>",
        f'<div class="answer">{"".join(pieces) or "<i>(empty answer)</i>"}</div>',
        f'<p class="meta">{len(gen.steps)} tokens, stopped at {escape(gen.stopped)}; prompt {gen.prompt_tokens} '
        f"tokens; policy: {escape(policy_words(gen.policy))}; calibration {calibrated}. Hover a token for its details "
        "(or open this page at #t&lt;index&gt;).</p>",
        _draws_line(gen),
        "<h2>Legend</h2>",
        '<div class="legend">',
        f'<span><span class="scale"></span> certificate '
        f"{_scale_caption(top, threshold, threshold_label, gen.reference_threshold)}</span>",
        '<span><span class="tok" style="background:hsl(120,65%,78%)">solid</span> trusted</span>',
        '<span><span class="tok untrusted" style="background:hsl(120,65%,78%)">dotted</span> untrusted</span>',
        '<span><span class="tok exact" style="background:hsl(120,65%,78%)">exact</span> read exactly with the '
        "prompt (certificate 0)</span>",
        '<span><span class="tok full" style="background:hsl(120,65%,78%)">boxed</span> read with the full cache</span>',
        '<span><span class="tok none">grey</span> no certificate</span>',
        '<span><mark class="esc">&#8635; escalation</mark> re-read at a larger budget here</span>',
        "</div>",
        "<h2>Certificate and memory</h2>",
        f'<div class="summary">{escape(gen.summary())}</div>',
        f'<div class="memory"><span class="bar"><i style="width:{width:.1f}%"></i></span>'
        f"<span>KV cache held {_mib(gen.kv_bytes)} vs {_mib(gen.full_kv_bytes)} for the full cache "
        f"({100 * share:.0f}%){held_note}</span></div>",
        f"<details><summary>Per-token table ({len(gen.steps)} tokens)</summary>{_token_table(gen)}</details>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(p for p in body if p)
        + "\n</body></html>\n"
    )


def write_html(generation: Generation, path: str | Path, **kwargs) -> Path:
    """Write `render_html(generation, **kwargs)` to path (UTF-8); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(generation, **kwargs), encoding="utf-8")
    return path
